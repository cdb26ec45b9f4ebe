"""Print the package's dependencies (plus extras) from pyproject.toml, one per line.

Images install these in a layer of their own before the package itself (`--no-deps`), so a
code change rebuilds only the small last layer. Usage: python requirements.py PYPROJECT [EXTRA...]
"""

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    """`project.dependencies` followed by the requirements of each extra."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
