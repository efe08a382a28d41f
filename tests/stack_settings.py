"""Settings shared by the e2e stack fixtures and the tests that rely on them."""

#: Short vLLM timeouts for the fault tests, so a registration that never
#: matches and a lease that runs out end within seconds, not minutes.
FAULT_REGISTRATION_TIMEOUT_S = 15
FAULT_KV_LEASE_S = 20


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
