// The native extension's module (extension.py builds it): what each source defines, registered under one name.
#include <torch/extension.h>

void register_t5(pybind11::module_& m);    // steps/t5/native.cpp: the T5 step, its encoder and products
void register_search(pybind11::module_& m);  // strategies/native_search.cpp: beam and greedy search steps' bookkeeping

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_t5(m);
  register_search(m);
}
