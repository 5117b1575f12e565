// Dtype dispatch over exactly the float types the ops accept (fp32, bf16, fp16), so no kernel is
// instantiated for a type that validation already rejects.
#pragma once

#include <ATen/Dispatch.h>

#define SGLD_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)          \
  AT_DISPATCH_SWITCH(TYPE, NAME,                            \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
