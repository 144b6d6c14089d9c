"""The only place that knows other libraries' versions and reaches past their public API (see each module)."""

from __future__ import annotations

from importlib import metadata


class VersionError(RuntimeError):
    """An installed library is not a release that a reach in compat/ was written for."""


def installed(*dists: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of `dists` that is installed, None when none is."""
    for dist in dists:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def release(version: str, parts: int = 2) -> str:
    """The first `parts` parts of a version, local tag dropped: "0.24.0+cu130" -> "0.24"."""
    return ".".join(version.split("+")[0].split(".")[:parts])


def written_for(what: str, module: str, supported: dict[str, tuple[str, ...]], found=...) -> str:
    """The installed version when `what` (a reach in compat/`module`.py) was written for its release, one of
    `supported` ({distribution: releases, each of as many parts as it compares}); else VersionError naming both.
    `found`: the (distribution, version) to check, or None for none installed; left out, it is looked up."""
    found = installed(*supported) if found is ... else found
    if found is None or not any(release(found[1], len(r.split("."))) == r for r in supported.get(found[0], ())):
        want = " or ".join(f"{dist} {' or '.join(r + '.x' for r in rs)}" for dist, rs in supported.items())
        have = f"{' / '.join(supported)} is not installed" if found is None else f"{found[0]} {found[1]} is installed"
        raise VersionError(f"{what} (molt_hydra/compat/{module}.py) is written for {want}; {have}")
    return found[1]
