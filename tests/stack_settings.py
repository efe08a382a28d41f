"""Settings shared by the e2e stack fixtures and the tests that rely on them."""

#: Short vLLM timeouts for the fault tests, so a registration that never
#: matches and a lease that runs out end within seconds, not minutes. The
#: lease stays well above a healthy handoff on a loaded 2-core box (tens of
#: ms; seconds at worst), so no healthy request expires.
FAULT_REGISTRATION_TIMEOUT_S = 15
FAULT_KV_LEASE_S = 8
#: How long the health faults freeze D (SIGSTOP): longer than the lease, so
#: P releases the KV while D cannot read it, and longer than the alert
#: rules' 10 s bound on an open handoff plus their 5 s ``for``.
FAULT_FREEZE_S = 20


def offline_stack(tmp_path, **kw):
    """A ``Stack`` for tests that build command lines and plans without
    starting anything: a stand-in model directory, homes under ``tmp_path``."""
    from kvlens.stack.launch import Stack

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return Stack(
        **{
            "mode": "push",
            "model": model,
            "kvlens_home": tmp_path / "home",
            "log_dir": tmp_path / "run",
            "port": 0,
            "quiet": True,
            **kw,
        }
    )
