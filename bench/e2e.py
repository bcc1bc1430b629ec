"""End-to-end generation benchmark (same as `camkv bench`): python bench/e2e.py --help."""

from camkv.benchmarks import main

if __name__ == "__main__":
    main()
