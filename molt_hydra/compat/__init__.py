"""The only place that knows other libraries' versions and reaches past their public API (see each module)."""

from __future__ import annotations

from importlib import metadata


def written_for(what: str, module: str, dist: str, releases: tuple[str, ...]) -> str:
    """The installed version of `dist` when its release (as many leading parts as `releases` give) is one of
    `releases`, the ones `what` (a reach in compat/`module`.py) was written for; else RuntimeError naming both."""
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = None
    parts = len(releases[0].split("."))
    if version is None or ".".join(version.split("+")[0].split(".")[:parts]) not in releases:
        have = f"{dist} is not installed" if version is None else f"{dist} {version} is installed"
        raise RuntimeError(f"{what} (molt_hydra/compat/{module}.py) is written for {dist} "
                           f"{' or '.join(r + '.x' for r in releases)}; {have}")
    return version
