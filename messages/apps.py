from django.apps import AppConfig


class A2AConfig(AppConfig):
    # `messages` is django.contrib.messages' label; the a2a_message table lives here.
    name = "messages"
    label = "a2a"
    verbose_name = "A2A messages"

    def ready(self) -> None:
        # The roster shows the load the console routes by; it may not import this app, so
        # the reader is handed to it here (roster/loads.py).
        from messages.backpressure import loads_kept
        from roster.loads import kept_counts_register

        kept_counts_register(loads_kept)
