"""``python -m stepd``: the same command line as the ``stepd`` script."""

from stepd.cli import main

if __name__ == "__main__":
    main(prog_name="stepd")
