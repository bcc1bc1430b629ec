"""End-to-end generation benchmark (same as `camkv bench`): python bench/e2e.py --help."""

from camkv.eval.bench import main

if __name__ == "__main__":
    main()
