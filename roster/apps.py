from django.apps import AppConfig


class RosterConfig(AppConfig):
    name = "roster"
    verbose_name = "Roster"

    def ready(self) -> None:
        from django.urls import register_converter

        from roster.converters import AgentIdConverter

        # Before any URLconf is read: the roster's, the messages' and the directory's pages
        # all name agents in their addresses.
        register_converter(AgentIdConverter, "agent")
