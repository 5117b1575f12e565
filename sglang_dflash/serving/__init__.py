"""SGLang integration: the `sglang.srt.plugins` entry point and the DFLASH worker subclass.

The only part of sglang_dflash that imports SGLang. Importing this package imports nothing heavy;
`plugin.register` runs in every SGLang process, and the worker module is imported lazily, only
in the scheduler process that builds the DFLASH worker. See docs/serving.md.
"""
