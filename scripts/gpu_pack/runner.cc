// The GPU check's runner: runs one tvm_fusion artifact on a CPU or a CUDA device with the TVM
// runtime alone (no Python, no TVM package), writes its outputs and times it with TVM's own
// timer: CUDA events on a CUDA device, a steady clock on the CPU.
//
//   runner LIBRARY DEVICE OUTDIR WARMUP REPEAT INPUT...
//     DEVICE  cpu | cuda (cuda loads libtvm_runtime_cuda.so from the folder of libtvm_runtime.so,
//             or $GPU_PACK_CUDA_RUNTIME)
//     INPUT   DTYPE:SHAPE:FILE, a raw little-endian array, e.g. int64:1x128:input_ids.bin
//
// Inputs are copied to the device once. The model runs WARMUP times, the outputs of the last run
// go to OUTDIR/output<i>.bin, then TVM's time evaluator ("runtime.RPCTimeEvaluator", one call
// per measurement, the device synchronized before each) measures REPEAT more runs. Stdout:
//   output <i> <dtype> <shape>      one line per output
//   times_ms <t1> <t2> ...          REPEAT per-run times in milliseconds
// Exit status 1 on any error, with the TVM error on stderr; 2 on bad arguments.
//
// Built by scripts/gpu_pack/pack.py against the TVM wheel's libraries (the folder ../lib next to
// the binary is its rpath), and again by run.sh with the host's g++ if that binary cannot start.
#include <dlfcn.h>
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

constexpr int kPooledAllocator = 2;  // tvm.runtime.vm.VirtualMachine.POOLED_ALLOCATOR

struct HostAlloc {
  void AllocData(DLTensor* tensor) {
    size_t size = ffi::GetDataSize(*tensor);
    tensor->data = std::aligned_alloc(64, (size + 63) / 64 * 64 + 64);
  }
  void FreeData(DLTensor* tensor) { std::free(tensor->data); }
};

std::vector<int64_t> ParseShape(const std::string& text) {
  std::vector<int64_t> shape;
  std::stringstream stream(text);
  std::string dim;
  while (std::getline(stream, dim, 'x')) {
    if (!dim.empty()) shape.push_back(std::stoll(dim));
  }
  return shape;
}

// The folder of the loaded libtvm_runtime.so, where the pack keeps its sibling libraries.
std::string RuntimeDir() {
  Dl_info info;
  void* symbol = dlsym(RTLD_DEFAULT, "TVMBackendAllocWorkspace");
  if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return ".";
  std::string path(info.dli_fname);
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

void LoadCudaRuntime() {
  const char* chosen = std::getenv("GPU_PACK_CUDA_RUNTIME");
  std::string path = chosen ? chosen : RuntimeDir() + "/libtvm_runtime_cuda.so";
  // RTLD_GLOBAL: the CUDA module loader and device API register themselves when it loads.
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    throw std::runtime_error("cannot load the TVM CUDA runtime " + path + ": " + dlerror());
  }
}

ffi::Tensor ReadInput(const std::string& spec, DLDevice device) {
  size_t first = spec.find(':');
  size_t second = spec.find(':', first + 1);
  if (first == std::string::npos || second == std::string::npos) {
    throw std::runtime_error("input '" + spec + "' is not DTYPE:SHAPE:FILE");
  }
  DLDataType dtype = ffi::StringToDLDataType(spec.substr(0, first));
  ffi::Shape shape(ParseShape(spec.substr(first + 1, second - first - 1)));
  std::string path = spec.substr(second + 1);
  ffi::Tensor host = ffi::Tensor::FromNDAlloc(HostAlloc(), shape, dtype, DLDevice{kDLCPU, 0});
  size_t size = ffi::GetDataSize(host);
  std::ifstream file(path, std::ios::binary);
  file.read(static_cast<char*>(host.data_ptr()), static_cast<std::streamsize>(size));
  if (!file || file.peek() != EOF) {
    throw std::runtime_error("input file " + path + " does not hold exactly " +
                             std::to_string(size) + " bytes");
  }
  // A tensor from TVM's allocator on the device, filled from the host copy (as tvm.runtime.tensor
  // does); on the CPU too, so the CPU twin takes the very path a GPU run takes.
  ffi::Tensor placed = ffi::Function::GetGlobalRequired("runtime.TVMTensorAllocWithScope")(
                           shape, dtype, device, ffi::Optional<ffi::String>())
                           .cast<ffi::Tensor>();
  ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromBytes")(placed, host.data_ptr(), size);
  return placed;
}

void WriteOutput(const ffi::Tensor& tensor, size_t index, const std::string& out_dir) {
  size_t size = ffi::GetDataSize(tensor);
  std::vector<char> bytes(size);
  // Copies from any device (a blocking copy, so it also waits for the run to finish).
  ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyToBytes")(
      tensor, static_cast<void*>(bytes.data()), size);
  std::string path = out_dir + "/output" + std::to_string(index) + ".bin";
  std::ofstream file(path, std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(size));
  if (!file) throw std::runtime_error("cannot write " + path);
  std::cout << "output " << index << " " << ffi::DLDataTypeToString(tensor.dtype()) << " ";
  ffi::ShapeView shape = tensor.shape();
  for (size_t i = 0; i < shape.size(); ++i) std::cout << (i ? "x" : "") << shape[i];
  std::cout << "\n";
}

int Run(int argc, char** argv) {
  std::string library = argv[1], device_name = argv[2], out_dir = argv[3];
  int warmup = std::stoi(argv[4]), repeat = std::stoi(argv[5]);
  if (device_name != "cpu" && device_name != "cuda") {
    std::cerr << "runner: DEVICE must be cpu or cuda, not " << device_name << "\n";
    return 2;
  }
  DLDevice device{device_name == "cuda" ? kDLCUDA : kDLCPU, 0};
  if (device.device_type == kDLCUDA) LoadCudaRuntime();

  ffi::Module executable =
      ffi::Function::GetGlobalRequired("ffi.ModuleLoadFromFile")(library).cast<ffi::Module>();
  ffi::Module vm = executable->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  // The device, then the host CPU that runs the VM's shape code (as relax.VirtualMachine does).
  if (device.device_type == kDLCPU) {
    vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, kPooledAllocator);
  } else {
    vm->GetFunction("vm_initialization").value()(static_cast<int>(device.device_type), 0,
                                                 kPooledAllocator, static_cast<int>(kDLCPU), 0,
                                                 kPooledAllocator);
  }
  std::vector<ffi::Any> inputs;
  for (int i = 6; i < argc; ++i) inputs.emplace_back(ReadInput(argv[i], device));
  std::vector<ffi::AnyView> args(inputs.begin(), inputs.end());
  ffi::Function main_function = vm->GetFunction("main").value();

  ffi::Any result;
  for (int i = 0; i < (warmup > 0 ? warmup : 1); ++i) {
    main_function.CallPacked(args.data(), static_cast<int32_t>(args.size()), &result);
  }
  if (auto tensor = result.as<ffi::Tensor>()) {
    WriteOutput(*tensor, 0, out_dir);
  } else {
    auto outputs = result.cast<ffi::Array<ffi::Any>>();
    for (size_t i = 0; i < outputs.size(); ++i) WriteOutput(outputs[i].cast<ffi::Tensor>(), i, out_dir);
  }
  result = ffi::Any();

  if (repeat > 0) {
    // number=1 run per measurement, `repeat` measurements, no minimum duration, no cool-down, no
    // cache flush: the arguments tvm.runtime.Module.time_evaluator passes, in its order.
    ffi::Function evaluator = ffi::Function::GetGlobalRequired("runtime.RPCTimeEvaluator")(
                                  vm, ffi::String("main"), static_cast<int>(device.device_type), 0,
                                  1, repeat, 0, 100, 0, 1, 0, ffi::String(""))
                                  .cast<ffi::Function>();
    ffi::Any blob;
    evaluator.CallPacked(args.data(), static_cast<int32_t>(args.size()), &blob);
    ffi::Bytes seconds = blob.cast<ffi::Bytes>();
    if (seconds.size() != sizeof(double) * static_cast<size_t>(repeat)) {
      throw std::runtime_error("the time evaluator returned " + std::to_string(seconds.size()) +
                               " bytes for " + std::to_string(repeat) + " runs");
    }
    std::cout << "times_ms";
    for (int i = 0; i < repeat; ++i) {
      double value;
      std::memcpy(&value, seconds.data() + i * sizeof(double), sizeof(double));
      std::cout << " " << value * 1e3;
    }
    std::cout << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: " << argv[0] << " LIBRARY cpu|cuda OUTDIR WARMUP REPEAT [DTYPE:SHAPE:FILE ...]\n";
    return 2;
  }
  try {
    return Run(argc, argv);
  } catch (const std::exception& err) {
    std::cerr << "runner: " << err.what() << "\n";
    return 1;
  }
}
