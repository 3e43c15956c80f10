"""Triton kernels and their plain-torch references (`<op>` beside `<op>_ref`).

Not to be confused with Hugging Face's `kernels` library, which has the same import name; the
test suite checks that `import kernels` resolves to this package.
"""
