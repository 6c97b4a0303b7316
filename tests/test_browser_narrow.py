"""At 390 px (a phone), in Chromium: every page fits its width (a table may scroll inside its
own box) and every nav item is on screen. Pages were 765-863 px wide and the nav was cut
after "Messages"."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission

from messages.models import Message
from messages.outbound import SendRequest, message_send
from reachconsole.core import roles
from tests.browser import chromium_page, sign_in
from tests.conftest import reader, register

WIDTH = 390
PAGES = ["/", "/overview/", "/tasks/", "/cluster/", "/messages/", "/directory/resolve/",
         "/alarms/", "/audit/", "/agents/fin.tax-statement-reconciliation/"]


@pytest.mark.django_db(transaction=True)
def test_every_page_fits_a_phone_and_every_nav_item_is_reachable(live_server, async_unsafe):
    user = reader("pia", password="pw-pia-123")
    for app_label, codename in roles.OPERATOR_PERMISSIONS:
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label,
                                                         codename=codename))
    # Long names, as real agents have, in every table.
    register("fin.tax-statement-reconciliation", "node-eu-west-1-production-a",
             capabilities=["tax-statement-reconciliation", "bank-statement"])
    register("llm.summarize", "node-eu-west-1-production-b", capabilities=["summarize"])
    for i in range(3):
        message_send(request=SendRequest(to="fin.tax-statement-reconciliation",
                                         task_id=f"t-narrow-{i}", payload={"i": i}))
    trace = f"/messages/{Message.objects.first().message_id}/"

    with chromium_page() as page:
        page.set_viewport_size({"width": WIDTH, "height": 800})
        sign_in(page, live_server.url, "pia", "pw-pia-123")
        for path in [*PAGES, trace]:
            page.goto(f"{live_server.url}{path}")
            page.wait_for_load_state("load")
            assert page.locator("h1").count() >= 1, path
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= WIDTH, f"{path} is {width} px wide at {WIDTH} px"
            links = page.locator("header.top nav a, header.top .logout button")
            assert links.count() >= 9, path
            for i in range(links.count()):
                box = links.nth(i).bounding_box()
                name = links.nth(i).inner_text()
                assert box is not None and box["width"] > 0, (path, name)
                assert box["x"] >= 0 and box["x"] + box["width"] <= WIDTH, (path, name, box)
