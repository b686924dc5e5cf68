"""``python -m lit_thresh``: the same as the ``lit_thresh`` command."""

from lit_thresh.cli import main

if __name__ == "__main__":
    main()
