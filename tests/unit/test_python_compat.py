"""compat/python.py: the forkserver state it reads is still CPython's, other releases are refused, and the scoped
environment restores what it changed (the live engine core fork: tests/integration/test_uni_engine.py)."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys

import pytest

from molt_hydra.compat import python as compat


def test_cpythons_forkserver_keeps_its_state_where_it_is_read():
    server = multiprocessing.forkserver._forkserver
    assert {"_forkserver_pid", "_forkserver_alive_fd"} <= set(vars(server))
    assert compat._server() is server
    assert compat.ForkedWithLaunchEnv().get_start_method() == "forkserver"


def test_other_pythons_are_refused(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    with pytest.raises(RuntimeError, match=r"the engine core's forkserver \(molt_hydra/compat/"
                       r"python.py\) is written for Python 3\.10\.x or .* or 3\.13\.x; Python 3\.14\.0 is installed"):
        compat.forkserver_unusable()


def test_scoped_env_restores_set_and_unset_variables(monkeypatch):
    monkeypatch.setenv("MOLT_A", "before")
    monkeypatch.delenv("MOLT_B", raising=False)
    with compat.scoped_env({"MOLT_A": "inside", "MOLT_B": "new"}):
        assert os.environ["MOLT_A"] == "inside" and os.environ["MOLT_B"] == "new"
    assert os.environ["MOLT_A"] == "before" and "MOLT_B" not in os.environ
