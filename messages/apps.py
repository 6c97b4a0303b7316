from django.apps import AppConfig


class A2AConfig(AppConfig):
    # `messages` is django.contrib.messages' label; the a2a_message table lives here.
    name = "messages"
    label = "a2a"
    verbose_name = "A2A messages"
