"""The kernel: what every app shares (the error base, service auth, audit, metrics, env
helpers). It imports no app and no other `reachconsole` module, so every app may import it
(pyproject.toml, [tool.importlinter])."""
