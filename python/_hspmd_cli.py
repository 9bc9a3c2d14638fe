"""The `hspmd` command of a pip-installed hspmd (docs/python.md, "Installing
with pip"): the console script's module. It replaces itself with the CLI,
hspmd/_bin/hspmd beside it (same process: signals reach the CLI directly).

A module of its own outside the package: an entry point inside hspmd would
import the package, and with it the extension, before every command."""
import os
import sys


def main():
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hspmd", "_bin", "hspmd")
    try:
        os.execv(exe, [sys.argv[0], *sys.argv[1:]])
    except OSError as e:
        sys.stderr.write(f"hspmd: error: cannot run {exe}: {e.strerror} (reinstall: pip install hspmd's checkout)\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
