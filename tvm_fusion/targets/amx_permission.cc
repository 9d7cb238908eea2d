// Linked into model.so for a target with AMX tiles (tvm_fusion/targets/platforms.py): Linux
// grants a process the AMX tile state only on request, and kills it (SIGILL) at the first tile
// instruction otherwise. This asks once, when the library is loaded, by whatever runtime loads it
// (tvm_fusion, plain TVM, the native runner), before any kernel runs. A refusal (a kernel before
// 5.16, a CPU without AMX) is left to show at the first tile instruction: the artifact metadata's
// requires_cpu_flags (amx_int8, amx_tile) already refuses such a machine by name.
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>

namespace {
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

__attribute__((constructor)) void tvm_fusion_request_amx_permission() {
  syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata);
}
}  // namespace
#endif
