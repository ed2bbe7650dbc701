"""Print the runtime dependencies of the given pyproject.toml files, one per line,
leaving out the monorepo's own tessera-* packages (installed from source later).

Used by the service Dockerfiles so that the dependency layer is built from the
package metadata alone and stays cached while only the source changes.
"""
import re
import sys
import tomllib

seen: dict[str, None] = {}
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        for dep in tomllib.load(f)["project"].get("dependencies", []):
            name = re.split(r"[\s<>=!~;\[(]", dep, maxsplit=1)[0].lower().replace("_", "-")
            if not name.startswith("tessera-"):
                seen[dep] = None
print("\n".join(seen))
