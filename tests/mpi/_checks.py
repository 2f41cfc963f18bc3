"""Helpers shared by the one-launch test scripts here (they run as scripts: this folder is on sys.path)."""


def expect_raises(failures, label, exc_types, fn):
    """Append to ``failures`` unless ``fn()`` raises one of ``exc_types``."""
    try:
        fn()
    except exc_types:
        return
    except Exception as exc:  # noqa: BLE001 - reported
        failures.append(f"{label}: raised {type(exc).__name__}: {str(exc)[:200]}")
        return
    failures.append(f"{label}: did not raise")
