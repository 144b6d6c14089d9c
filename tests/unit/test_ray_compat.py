"""compat/ray.py: once turned off, a Ray call made while no Ray runs raises instead of starting a Ray instance (a
trainer group's start, in a thread, did so after an interrupted run's ray.shutdown: tests/integration/test_faults.py)."""

from __future__ import annotations

import pytest
import ray
from ray._private import auto_init_hook

from molt_hydra.compat import ray as compat


def test_no_ray_call_starts_ray_once_auto_init_is_off(monkeypatch):
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", True)  # (restored after the test)
    assert not ray.is_initialized()
    compat.no_auto_init()
    with pytest.raises(Exception, match="Ray has not been started yet"):
        ray.put(1)
    assert not ray.is_initialized()


def test_other_rays_are_refused(monkeypatch):
    import molt_hydra.compat

    monkeypatch.setattr(molt_hydra.compat, "installed", lambda *dists: ("ray", "2.61.0"))
    with pytest.raises(molt_hydra.compat.VersionError, match=r"turning off Ray's auto-init \(molt_hydra/compat/ray.py\) "
                       r"is written for ray 2\.60\.x; ray 2\.61\.0 is installed"):
        compat.no_auto_init()
