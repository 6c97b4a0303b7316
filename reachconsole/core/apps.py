from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "reachconsole.core"
    label = "core"
    verbose_name = "Console kernel"
