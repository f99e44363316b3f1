"""`python -m extract.regen`: the target's own greedy answers as training data."""

from extract.regen.regenerate import main

if __name__ == "__main__":
    main()
