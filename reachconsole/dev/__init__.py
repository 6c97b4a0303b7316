"""Dev-only code: the embedded MQTT broker of `make run` and the simulated cluster.

It may import the apps (the simulator speaks messages.protocol); production modules never
import it, and importing it patches no library (pyproject.toml, [tool.importlinter]).
"""
