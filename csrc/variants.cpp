// The kernel-variant registry and the ops that list and select variants (variants.h). A selection
// belongs to the calling thread, so a scope that selects a variant (ops.variants.using_variant)
// changes no other thread's calls; it is read on the host at launch, so a CUDA graph keeps the
// variant that was selected while it was captured.
#include "sglang_dflash/variants.h"

#include <torch/library.h>

#include <array>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

namespace sglang_dflash {
namespace {

constexpr int kOps = static_cast<int>(VariantOp::kCount);
constexpr std::array<const char*, kOps> kOpNames = {"block_attention", "verify_block"};

struct Registry {
  std::mutex mutex;
  std::array<std::vector<std::string>, kOps> names;
};

Registry& registry() {
  static Registry r;  // constructed on first use: registrations run from other files' initializers
  return r;
}

thread_local std::array<int, kOps> selected{};  // 0: "default"

std::string joined(const std::vector<std::string>& names) {
  std::ostringstream s;
  for (size_t i = 0; i < names.size(); ++i) s << (i ? ", " : "") << '"' << names[i] << '"';
  return s.str();
}

VariantOp op_named(const std::string& op) {
  for (int i = 0; i < kOps; ++i) {
    if (op == kOpNames[i]) return static_cast<VariantOp>(i);
  }
  std::vector<std::string> ops(kOpNames.begin(), kOpNames.end());
  TORCH_CHECK_VALUE(false, "sglang_dflash.kernel_variants: no op named \"", op, "\" has kernel variants; ops with ",
                    "variants: ", joined(ops));
}

std::vector<std::string> names_of(VariantOp op) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const auto& names = r.names[static_cast<int>(op)];
  return names.empty() ? std::vector<std::string>{"default"} : names;
}

std::vector<std::string> kernel_variants(const std::string& op) { return names_of(op_named(op)); }

std::string selected_name(const std::string& op) {
  const VariantOp id = op_named(op);
  return names_of(id)[selected[static_cast<int>(id)]];
}

// Selects `name` for the calling thread's calls of `op`; returns the name selected before.
std::string select_kernel_variant(const std::string& op, const std::string& name) {
  const VariantOp id = op_named(op);
  const auto names = names_of(id);
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) {
      std::string before = names[selected[static_cast<int>(id)]];
      selected[static_cast<int>(id)] = static_cast<int>(i);
      return before;
    }
  }
  TORCH_CHECK_VALUE(false, "sglang_dflash.", op, ": no kernel variant \"", name, "\" in this build; its variants: ",
                    joined(names));
}

}  // namespace

bool register_kernel_variants(VariantOp op, std::vector<std::string> names) {
  TORCH_CHECK(!names.empty() && names[0] == "default", "sglang_dflash: ", kOpNames[static_cast<int>(op)],
              "'s kernel variants must list \"default\" first");
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  auto& slot = r.names[static_cast<int>(op)];
  TORCH_CHECK(slot.empty(), "sglang_dflash: ", kOpNames[static_cast<int>(op)], "'s kernel variants registered twice");
  slot = std::move(names);
  return true;
}

int selected_kernel_variant(VariantOp op) { return selected[static_cast<int>(op)]; }

}  // namespace sglang_dflash

TORCH_LIBRARY_FRAGMENT(sglang_dflash, m) {
  m.def("kernel_variants(str op) -> str[]", &sglang_dflash::kernel_variants);
  m.def("selected_kernel_variant(str op) -> str", &sglang_dflash::selected_name);
  m.def("select_kernel_variant(str op, str name) -> str", &sglang_dflash::select_kernel_variant);
}
