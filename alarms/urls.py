from django.urls import path

from alarms import views

app_name = "alarms"
urlpatterns = [
    path("", views.alarm_list, name="list"),
    path("<int:alarm_id>/ack", views.alarm_ack, name="ack"),
]
