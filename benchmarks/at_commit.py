"""Run a benchmark from another commit's source tree, so that a measurement and its baseline run in
one device call on one machine (the device tool may hand out another machine, even another GPU, for
the next call).

    git archive REV builder kernels runtime templates benchmarks pyproject.toml | tar x -C .baseline
    python benchmarks/at_commit.py --tree .baseline -- benchmarks/families.py --out OUT ...

The tree's builder/, kernels/, runtime/ and templates/ are imported as ``pagecast`` through links in
a temporary directory put first on PYTHONPATH, and the script (a path inside the tree) runs with the
tree as its working directory (relative paths among its arguments are the tree's); its exit status
is this one's. On the device machine, carry the tree
(an ignored path: list it in .git/info/exclude here).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE_DIRS = ("builder", "kernels", "runtime", "templates")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, required=True, help="the exported source tree of the other commit")
    ap.add_argument("script", help="the benchmark, a path inside the tree")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    args = ap.parse_args()
    tree = args.tree.resolve()
    missing = [d for d in PACKAGE_DIRS if not (tree / d).is_dir()]
    if missing or not (tree / args.script).is_file():
        sys.exit(
            f"{tree} lacks {', '.join(missing) or args.script}: export the commit there first "
            "(git archive REV builder kernels runtime templates benchmarks pyproject.toml | tar x -C TREE)"
        )
    with tempfile.TemporaryDirectory(prefix="pagecast-at-commit-") as tmp:
        package = Path(tmp) / "pagecast"
        package.mkdir()
        (package / "__init__.py").write_text('"""pagecast, as exported from another commit."""\n')
        for d in PACKAGE_DIRS:
            (package / d).symlink_to(tree / d)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])))
        rc = subprocess.run([sys.executable, args.script, *args.args], cwd=tree, env=env, check=False).returncode
    sys.exit(rc)


if __name__ == "__main__":
    main()
