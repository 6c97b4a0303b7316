from django.apps import AppConfig


class DirectoryConfig(AppConfig):
    name = "directory"
    verbose_name = "Directory"
