"""sglang-dflash: DFlash block-diffusion speculative decoding for SGLang, with custom kernels.

Importing this package is cheap: it imports neither SGLang nor the compiled extension. The ops in
`sglang_dflash.ops` load the extension on first use.
"""

__version__ = "0.1.0"
