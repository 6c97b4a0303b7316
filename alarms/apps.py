from django.apps import AppConfig


class AlarmsConfig(AppConfig):
    # Alarms read every app (the numbers, the roster, the directory's coverage) and what
    # readiness knows of the broker; no app imports them (pyproject.toml, import-linter).
    name = "alarms"
    verbose_name = "Alarms"
