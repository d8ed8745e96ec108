"""sglang-spex kernels, and the ``sgl_kernel`` stand-in SGLang needs on machines where no real one loads.

Import-light on purpose: the ``.pth`` hook imports :mod:`sgl_kernel_ext.finder` in every interpreter.
"""

__version__ = "0.1.0"
