"""What the console's browser tests share: a page that records what it must not do, signing
in, routes, screenshots, and the check that nothing from data became markup or ran."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

TIMEOUT_MS = 15_000


class HasShots(Protocol):
    """A test module's world: where its screenshots go."""

    shots: Path


@dataclass
class Watch:
    """What a page did that it must not: dialogs, script errors, CSP refusals."""

    dialogs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    console: list[str] = field(default_factory=list)


def open_page(browser: Any, url: str) -> tuple[Any, Watch]:
    page = browser.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    watch = Watch()

    def on_dialog(dialog: Any) -> None:
        watch.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    page.on("pageerror", lambda exc: watch.errors.append(str(exc)))
    page.on("console", lambda msg: watch.console.append(f"{msg.type}: {msg.text}")
            if msg.type in ("error", "warning") else None)
    page.goto(url + "/ui/")
    return page, watch


def sign_in(page: Any, key: str, *, refused: bool = False) -> None:
    page.locator("#key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    if refused:
        page.get_by_text("The daemon refused this key.").wait_for()
    else:
        page.locator("nav.tabs a.active").wait_for()


def goto(page: Any, route: str) -> None:
    page.evaluate("route => { location.hash = route; }", route)


def shoot(page: Any, where: HasShots, name: str) -> None:
    """A full-page picture into ``where.shots`` (docs/console/ when asked: docs/console.md)."""
    page.wait_for_timeout(150)  # let the last render settle
    page.screenshot(path=str(where.shots / f"{name}.png"), full_page=True)


def assert_clean(page: Any, watch: Watch) -> None:
    """Nothing from data became markup, ran, or was refused by the CSP."""
    assert watch.dialogs == [], watch.dialogs
    assert watch.errors == [], watch.errors
    assert not [m for m in watch.console if "Content Security Policy" in m or "Trusted" in m
                or "Refused" in m], watch.console
    found = page.evaluate("""() => ({
        pwned: window.__pwned === undefined ? null : String(window.__pwned),
        scripts: [...document.scripts].map(s => s.getAttribute('src')),
        imgs: [...document.images].map(i => i.getAttribute('src')),
        iframes: document.querySelectorAll('iframe, object, embed, svg, frame').length
            + [...document.querySelectorAll('b')].filter(b => b.textContent === 'bold').length,
        handlers: [...document.querySelectorAll('*')].flatMap(el =>
            [...el.attributes].filter(a => a.name.startsWith('on')).map(a => el.tagName + ' ' + a.name)),
        hrefs: [...document.querySelectorAll('[href]')].map(el => el.getAttribute('href'))
            .filter(h => !/^(#\\/|\\.\\/)/.test(h)),
    })""")
    assert found["pwned"] is None, found
    assert found["scripts"] == ["./js/app.js"], found
    assert found["imgs"] == ["./favicon.svg"], found
    assert found["iframes"] == 0, found
    assert found["handlers"] == [], found
    assert found["hrefs"] == [], found
