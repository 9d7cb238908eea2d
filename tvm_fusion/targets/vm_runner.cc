// Runs an exported tvm_fusion artifact with nothing but the TVM runtime (no Python): the way a
// deployment host without Python would, and the way tvm_fusion runs an aarch64 artifact under
// qemu-user on an x86 machine (tvm_fusion.targets.emulation builds this file with the cross compiler).
//
//   vm_runner LIBRARY OUTDIR INPUT...      INPUT = DTYPE:SHAPE:FILE, e.g. float32:1x128:x.bin
//
// Inputs are raw little-endian arrays in the order metadata.json lists them (SHAPE is empty for
// a scalar). Each output i is written to OUTDIR/output<i>.bin, and one line
// "output <i> <dtype> <shape>" per output goes to stdout. Exit status 1 on any error, with the
// TVM error on stderr.
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
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

ffi::Tensor ReadInput(const std::string& spec) {
  size_t first = spec.find(':');
  size_t second = spec.find(':', first + 1);
  if (first == std::string::npos || second == std::string::npos) {
    throw std::runtime_error("input '" + spec + "' is not DTYPE:SHAPE:FILE");
  }
  DLDataType dtype = ffi::StringToDLDataType(spec.substr(0, first));
  std::vector<int64_t> shape = ParseShape(spec.substr(first + 1, second - first - 1));
  std::string path = spec.substr(second + 1);
  ffi::Tensor tensor = ffi::Tensor::FromNDAlloc(HostAlloc(), ffi::Shape(shape), dtype,
                                                DLDevice{kDLCPU, 0});
  size_t size = ffi::GetDataSize(tensor);
  std::ifstream file(path, std::ios::binary);
  file.read(static_cast<char*>(tensor.data_ptr()), static_cast<std::streamsize>(size));
  if (!file || file.peek() != EOF) {
    throw std::runtime_error("input file " + path + " does not hold exactly " +
                             std::to_string(size) + " bytes");
  }
  return tensor;
}

void WriteOutput(const ffi::Tensor& tensor, size_t index, const std::string& out_dir) {
  std::string path = out_dir + "/output" + std::to_string(index) + ".bin";
  std::ofstream file(path, std::ios::binary);
  file.write(static_cast<const char*>(tensor.data_ptr()),
             static_cast<std::streamsize>(ffi::GetDataSize(tensor)));
  if (!file) throw std::runtime_error("cannot write " + path);
  std::cout << "output " << index << " " << ffi::DLDataTypeToString(tensor.dtype()) << " ";
  ffi::ShapeView shape = tensor.shape();
  for (size_t i = 0; i < shape.size(); ++i) std::cout << (i ? "x" : "") << shape[i];
  std::cout << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " LIBRARY OUTDIR [DTYPE:SHAPE:FILE ...]\n";
    return 2;
  }
  try {
    ffi::Module executable =
        ffi::Function::GetGlobalRequired("ffi.ModuleLoadFromFile")(std::string(argv[1]))
            .cast<ffi::Module>();
    ffi::Module vm = executable->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
    vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, kPooledAllocator);
    std::vector<ffi::Any> inputs;
    for (int i = 3; i < argc; ++i) inputs.emplace_back(ReadInput(argv[i]));
    std::vector<ffi::AnyView> args(inputs.begin(), inputs.end());
    ffi::Any result;
    vm->GetFunction("main").value().CallPacked(args.data(), static_cast<int32_t>(args.size()),
                                              &result);
    if (auto tensor = result.as<ffi::Tensor>()) {
      WriteOutput(*tensor, 0, argv[2]);
    } else {
      auto outputs = result.cast<ffi::Array<ffi::Any>>();
      for (size_t i = 0; i < outputs.size(); ++i) {
        WriteOutput(outputs[i].cast<ffi::Tensor>(), i, argv[2]);
      }
    }
  } catch (const std::exception& err) {
    std::cerr << "vm_runner: " << err.what() << "\n";
    return 1;
  }
  return 0;
}
