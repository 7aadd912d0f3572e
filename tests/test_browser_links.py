"""In Chromium: the customer chat shows a reply's addresses as links only where the shop vouches for
their site (ui/links.py); the others are text that cannot be clicked, while streaming and after a
reload. The whole app over a fake engine whose reply holds both kinds (a model's text cannot be chosen)."""
import pytest

import app as app_module
from storage import Store
from tests.fakes import FakeEngineClient
from tests.serving import LiveServer
from tests.test_browser_handoff import chromium  # noqa: F401  (the shared browser fixture)
from ui import assistants

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

REPLY = (" Start at https://northwind.example/returns or https://fake-returns.com/start; mail help@northwind.example,"
         " refunds@fake-returns.com or [the form](https://fake-returns.com/form).")


@pytest.fixture(scope="module")
def shop(tmp_path_factory, smol_tokenizer):
    db = str(tmp_path_factory.mktemp("browser-links") / "chat.db")
    store = Store(db)
    assistants.ensure_default(store)
    base = store.assistant(assistants.DEFAULT_SLUG)
    assistants.save(store, assistants.DEFAULT_SLUG,
                    {**base, "system_prompt": base["system_prompt"] + " Our website is https://northwind.example."}, "t")
    fake = FakeEngineClient(smol_tokenizer, max_model_len=4096, reply=REPLY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "make_client", lambda config, url: fake)
        app, client = app_module.build_app(app_module.parse_args(["--db", db]))
    with LiveServer(client, app) as server:
        yield server


def test_only_the_shops_own_addresses_are_links(shop, chromium):  # noqa: F811
    from playwright.sync_api import expect

    page = chromium.new_page()
    page.goto(f"{shop.url}/chat/support/")
    page.locator("#msg textarea").click()
    page.keyboard.type("How do I return my tent?")
    page.keyboard.press("Enter")
    for _ in range(2):  # as written, then as stored after a reload
        reply = page.locator("#chatbot [data-testid='bot']").last
        expect(reply).to_contain_text("or the form.")
        hrefs = [a.get_attribute("href") for a in reply.locator("a").all()]
        assert hrefs == ["https://northwind.example/returns", "mailto:help@northwind.example"]
        assert [c.inner_text() for c in reply.locator("code").all()] == ["https://fake-returns.com/start",
                                                                         "refunds@fake-returns.com"]
        page.reload()
