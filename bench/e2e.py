"""End-to-end generation benchmark (same as `camkv bench`): python bench/e2e.py --help."""

from camkv.eval.bench import main

if __name__ == "__main__":
    from camkv._blas import reexec_with_openblas

    reexec_with_openblas()  # the CPU's float32 matrix products by the system's OpenBLAS, where one exists
    main()
