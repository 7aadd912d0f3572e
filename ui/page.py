"""What every page carries besides its components: the theme (colours that pass WCAG AA contrast),
the CSS for phones, and the keyboard script: a skip link to the message box, one Tab stop for the
whole conversation (its per-message buttons reached by the arrow keys), Escape to cancel an edit,
and a label on the edit box. Passed to gr.mount_gradio_app(theme=, css=, js=)."""
from __future__ import annotations

import os

import gradio as gr

FAVICON = os.path.join(os.path.dirname(__file__), "favicon.svg")  # served at /favicon.ico (Gradio's pages link none)

# Gradio's default orange (#f97316) and red (#ef4444) buttons carry white text at 2.8:1 and 3.8:1;
# their 700 shades give 5.2:1 and 6.5:1 (AA asks 4.5:1 for text under 18.66 px bold). Subdued text
# (neutral 400, 2.5:1 on white) becomes neutral 600 (7.6:1).
THEME = gr.themes.Default().set(
    body_text_color_subdued="*neutral_600", body_text_color_subdued_dark="*neutral_300",  # slider ends, hints
    button_primary_background_fill="*primary_700", button_primary_background_fill_hover="*primary_800",
    button_primary_background_fill_dark="*primary_700", button_primary_background_fill_hover_dark="*primary_800",
    button_cancel_background_fill="#b91c1c", button_cancel_background_fill_hover="#991b1b",
    button_cancel_background_fill_dark="#b91c1c", button_cancel_background_fill_hover_dark="#991b1b",
)

CSS = """
.skip-link { position: absolute; left: 8px; top: -100px; z-index: 1000; padding: 8px 12px; border-radius: 6px;
  background: #1f2937; color: #fff; font-weight: 600; }
.skip-link:focus { top: 8px; }
.download-link { display: inline-block; margin: 4px 8px 4px 0; padding: 4px 12px; border-radius: 6px;
  border: 1px solid var(--border-color-primary); font-size: var(--text-sm); }
#assistant-name h1, h1.page-title { font-size: 1.15rem; margin: 0; }
/* code in a message wraps instead of scrolling: no scroll region that only a mouse could move */
#chatbot pre, #chatbot pre code { white-space: pre-wrap !important; overflow-wrap: anywhere; overflow: visible !important; }
/* an event with show_progress="hidden" still gets Gradio's timer text over the chat while it streams, pulsing
   in opacity: faint text (axe found it below AA contrast mid-pulse). Hidden means none at all. */
[data-testid="status-tracker"].hidden .progress-text { display: none; }
@media (max-width: 767px) {
  .sidebar:not(.open) .toggle-button { left: calc(100% + 3px); }  /* wholly on screen, left of the content */
  #chatbot .bubble-wrap { padding-top: 36px; }  /* the first bubble stays below the chat's own buttons */
  #model-line { font-size: 0.8rem; flex: 1 1 100% !important; }  /* a row of its own, two lines at most */
  #tokens-per-char { display: none; }  /* a detail for a wide screen: on a phone it wrapped to a fourth line */
}
"""

JS = """
() => {
  const ko = (document.cookie.match(/(?:^|; )pagedchat_lang=([^;]*)/) || [])[1] === 'ko' ||
    (!document.cookie.includes('pagedchat_lang=') && (navigator.language || '').startsWith('ko'));
  const words = ko ? {skip: '메시지 입력으로 건너뛰기', edit: '메시지 수정'}
                   : {skip: 'Skip to the message box', edit: 'Edit your message'};
  const box = () => document.querySelector('#msg textarea');
  const skip = document.createElement('a');
  skip.href = '#msg'; skip.className = 'skip-link'; skip.id = 'skip-to-message'; skip.textContent = words.skip;
  skip.addEventListener('click', (e) => { e.preventDefault(); box()?.focus(); });
  document.body.prepend(skip);

  // Gradio's toast header is role="button" around the toast's own close button (axe: nested-interactive,
  // a screen reader hears one control inside another): the close button stays the toast's one control.
  const plainToasts = () => document.querySelectorAll('.toast-header[role="button"]').forEach((h) => {
    h.removeAttribute('role'); h.removeAttribute('tabindex');
  });
  new MutationObserver(plainToasts).observe(document.body, {childList: true, subtree: true});

  // The conversation is one Tab stop: its per-message buttons (copy, edit, thumbs) are reached with the
  // arrow keys (roving tabindex), so Tab goes from the chat to the message box in one press.
  const editing = (chat) => chat.querySelector('.edit-textarea');
  const buttons = (chat) => [...chat.querySelectorAll('.message-buttons button, .code_wrap button')];
  let current = null;
  const rove = (chat) => {
    const all = buttons(chat);
    if (editing(chat)) { all.forEach((b) => b.removeAttribute('tabindex')); return; }
    if (!all.includes(current)) current = all[all.length - 1] || null;
    all.forEach((b) => b.setAttribute('tabindex', b === current ? '0' : '-1'));
  };
  let tries = 0;  // the chat renders after this script runs; pages without one (the console) give up
  const watch = () => {
    const chat = document.querySelector('#chatbot');
    if (!chat) return ++tries < 100 && setTimeout(watch, 200);
    const tidy = () => {
      rove(chat);
      // Gradio marks the quick replies role="list" around plain buttons (axe: aria-required-children)
      chat.querySelectorAll('.examples[role="list"]').forEach((e) => e.removeAttribute('role'));
      const area = editing(chat);
      if (area && !area.getAttribute('aria-label')) area.setAttribute('aria-label', words.edit);
    };
    tidy();
    new MutationObserver(tidy).observe(chat, {childList: true, subtree: true});
    chat.addEventListener('focusin', (e) => {
      if (buttons(chat).includes(e.target)) { current = e.target; rove(chat); }
    });
    chat.addEventListener('keydown', (e) => {
      if (e.key === 'Escape' && e.target.classList.contains('edit-textarea')) {
        let row = e.target.closest('.message-row')?.nextElementSibling;  // the message's buttons follow it
        while (row && !row.classList.contains('message-buttons')) row = row.nextElementSibling;
        const cancel = row ? [...row.querySelectorAll('button')].pop() : null;  // Submit, Cancel
        if (cancel) { e.preventDefault(); cancel.click(); }
        return;
      }
      const all = buttons(chat), at = all.indexOf(e.target);
      const step = {ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1}[e.key];
      if (at < 0 || (!step && e.key !== 'Home' && e.key !== 'End')) return;
      e.preventDefault();
      const next = e.key === 'Home' ? 0 : e.key === 'End' ? all.length - 1
                 : Math.min(all.length - 1, Math.max(0, at + step));
      current = all[next]; rove(chat); current.focus();
    });
  };
  watch();
}
"""


def assets() -> dict:
    """The mount_gradio_app arguments every page takes."""
    return dict(theme=THEME, css=CSS, js=JS)
