from django.apps import AppConfig


class ReachConsoleConfig(AppConfig):
    name = "reachconsole"
    verbose_name = "reachconsole"
