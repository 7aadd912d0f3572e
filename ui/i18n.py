"""The customer chat in English and Korean. Component text goes through gr.I18n, which takes the
request's Accept-Language; what the server says (status lines, notices) through `say`, in the
same language. The page's switch sets the `pagedchat_lang` cookie, which
server.middleware.LanguageCookieMiddleware turns into that request's Accept-Language."""
from __future__ import annotations

import gradio as gr

LANG_COOKIE = "pagedchat_lang"
LANGUAGES = ("en", "ko")

TEXT = {
    "en": {
        "chats": "Chats", "new_chat": "New chat", "search": "Search chats", "your_chats": "Your chats",
        "title": "Title", "rename": "Rename", "delete": "Delete", "transfer": "Export, import",
        "export_md": "Export Markdown", "export_json": "Export JSON", "download": "Download",
        "import": "Import a chat (JSON)", "delete_all": "Delete all my chats",
        "confirm_delete_all": "Delete **every** chat of yours? This cannot be undone.",
        "confirm_yes": "Yes, delete all", "cancel": "Cancel",
        "confirm_delete": "Delete this chat? This cannot be undone.", "confirm_delete_yes": "Delete it", "theme": "Light / dark", "language": "한국어",
        "comment": "What was good or wrong about this reply? (optional)", "send_feedback": "Send feedback",
        "message": "Type a message · Enter sends · Shift+Enter starts a new line", "send": "Send", "stop": "Stop",
        "regenerate": "Regenerate", "person": "Talk to a person", "chat": "Chat",
        "back_to_assistant": "Back to the assistant",
    },
    "ko": {
        "chats": "대화", "new_chat": "새 대화", "search": "대화 검색", "your_chats": "내 대화", "title": "제목",
        "rename": "이름 바꾸기", "delete": "삭제", "transfer": "내보내기, 가져오기", "export_md": "Markdown으로 내보내기",
        "export_json": "JSON으로 내보내기", "download": "다운로드", "import": "대화 가져오기 (JSON)",
        "delete_all": "내 대화 모두 삭제", "confirm_delete_all": "내 대화를 **모두** 삭제할까요? 되돌릴 수 없습니다.",
        "confirm_yes": "네, 모두 삭제", "cancel": "취소",
        "confirm_delete": "이 대화를 삭제할까요? 되돌릴 수 없습니다.", "confirm_delete_yes": "삭제하기", "theme": "밝게 / 어둡게", "language": "English",
        "comment": "이 답변의 좋았던 점이나 잘못된 점은? (선택)", "send_feedback": "의견 보내기",
        "message": "메시지 입력 · Enter로 보내기 · Shift+Enter로 줄 바꿈", "send": "보내기", "stop": "중지",
        "regenerate": "다시 생성", "person": "상담원 연결", "chat": "상담",
        "back_to_assistant": "어시스턴트와 계속 대화",
    },
}

# What the server says to a customer, by language.
SAID = {
    "en": {
        "waiting": "Waiting for a person: you are number {place} in line. They will see this whole chat; the "
                   "assistant does not answer meanwhile.",
        "waiting_offline": "No one from our team is online right now. Your chat waits in line (number {place}) "
                           "and a person answers here when they are back; the assistant does not answer "
                           "meanwhile. You can go back to the assistant instead.",
        "waiting_closed": "Our team answers chats {hours}, so no one is here right now. Your chat waits in line "
                          "(number {place}) and a person answers here from {next}; the assistant does not answer "
                          "meanwhile. You can go back to the assistant instead.",
        "with_agent": "You are chatting with **{agent}**, a person from our team.",
        "person_busy": "A person is looking after this chat: the assistant does not answer until they hand it back.",
        "no_edit_with_person": "A person is looking after this chat: send a new message instead of editing.",
        "own_messages": "Only your own messages can be edited.",
        "deleted": "Deleted {n} chat(s).", "thanks": "Thanks for the feedback.",
        "card_hidden": "For your safety we do not keep card numbers: only the last four digits of the one in your "
                       "message were kept. Please never send a card's full number or security code in a chat.",
        "imported": "Imported \"{title}\" as a new chat.", "import_failed": "Could not import that file: {why}",
        "new_chat": "New chat", "set_by_shop": "The assistant's instructions are set by the shop's operators.",
        "storage_busy": "Your message could not be saved just now, so it was not sent: it is back in the box. "
                        "Please try again in a moment.",
        "loading": "The assistant is starting (loading the model). You can type now: your message is answered "
                   "as soon as it is ready.",
        "no_assistant": "There is no assistant at {address}.",
        "already_answering": "This chat is already answering (in another tab?): wait for the reply or press Stop.",
        "still_answering": "The reply is still being written, so your message was not sent: it stays in the box. "
                           "Send it when the reply is done, or press Stop.",
        "wait_for_reply": "The reply is still being written: wait for it to finish, or press Stop.",
        "not_yours": "This chat does not exist or is not yours.",
        "nothing_to_regenerate": "There is no reply to regenerate yet.",
        "too_long": "This message makes the conversation {tokens} tokens long; the assistant reads at most {limit}. "
                    "Start a new chat or send a shorter message.",
        "deleted_mid_reply": "This chat was deleted while the reply was being written; the reply stopped.",
        "busy": "The assistant is very busy right now and could not take your message: it is back in the box. "
                "Please try again in a moment.",
        "too_many": "You already have replies being written in other chats: wait for one to finish, then send again.",
        "unavailable": "The assistant is not available right now, so your message was not sent: it is back in the "
                       "box. Please try again in a moment, or talk to a person.",
        "unavailable_alone": "The assistant is not available right now, so your message was not sent: it is back in "
                             "the box. Please try again in a moment.",
        "reply_cut": "The reply was cut short by a problem on our side. What was written is kept: send again to "
                     "continue.",
        "reply_cut_storage": "The reply was cut short: the chat could not be saved just now. Please try again in a "
                             "moment.",
    },
    "ko": {
        "waiting": "상담원 연결 대기 중: 대기 순서 {place}번입니다. 상담원이 이 대화 전체를 보게 되며, 그동안 "
                   "어시스턴트는 답하지 않습니다.",
        "waiting_offline": "지금은 연결 가능한 상담원이 없습니다. 대화는 대기 순서 {place}번으로 남아 있고, 상담원이 "
                           "돌아오면 여기에서 답변드립니다. 그동안 어시스턴트는 답하지 않으며, 대신 어시스턴트와 계속 "
                           "대화할 수도 있습니다.",
        "waiting_closed": "상담원 운영 시간은 {hours}이라 지금은 상담원이 없습니다. 대화는 대기열({place}번째)에 남아 "
                          "있고 {next}부터 상담원이 이곳에서 답변합니다. 그동안 어시스턴트는 답하지 않습니다. 대신 "
                          "어시스턴트와 계속 대화할 수도 있습니다.",
        "with_agent": "지금 상담원 **{agent}** 님과 대화 중입니다.",
        "person_busy": "상담원이 이 대화를 맡고 있습니다. 상담원이 넘겨줄 때까지 어시스턴트는 답하지 않습니다.",
        "no_edit_with_person": "상담원이 이 대화를 맡고 있습니다. 수정 대신 새 메시지를 보내 주세요.",
        "own_messages": "내가 보낸 메시지만 수정할 수 있습니다.",
        "deleted": "대화 {n}개를 삭제했습니다.", "thanks": "의견 감사합니다.",
        "card_hidden": "고객님의 안전을 위해 카드 번호는 보관하지 않습니다: 메시지 속 카드 번호는 끝 네 자리만 남겼습니다. "
                       "채팅으로 카드 번호 전체나 보안 코드(CVC)를 보내지 마세요.",
        "imported": "\"{title}\" 대화를 새 대화로 가져왔습니다.", "import_failed": "파일을 가져올 수 없습니다: {why}",
        "new_chat": "새 대화", "set_by_shop": "어시스턴트의 지침은 매장 운영자가 정합니다.",
        "storage_busy": "지금은 메시지를 저장할 수 없어 보내지 못했습니다. 입력창에 그대로 있으니 잠시 후 다시 "
                        "시도해 주세요.",
        "loading": "어시스턴트를 시작하는 중입니다 (모델 불러오는 중). 지금 입력하셔도 됩니다. 준비되는 대로 답변해 "
                   "드립니다.",
        "no_assistant": "{address}에는 상담 창구가 없습니다.",
        "already_answering": "이 대화는 이미 답변 중입니다 (다른 탭에서?). 답변을 기다리거나 중지를 눌러 주세요.",
        "still_answering": "아직 답변을 작성하는 중이라 메시지를 보내지 않았습니다. 메시지는 입력란에 남아 있으니 답변이 "
                           "끝난 뒤 보내거나 중지를 눌러 주세요.",
        "wait_for_reply": "아직 답변을 작성하는 중입니다. 답변이 끝날 때까지 기다리거나 중지를 눌러 주세요.",
        "not_yours": "이 대화가 없거나 내 대화가 아닙니다.",
        "nothing_to_regenerate": "아직 다시 생성할 답변이 없습니다.",
        "too_long": "이 메시지를 보내면 대화가 {tokens}토큰이 되어, 어시스턴트가 읽을 수 있는 {limit}토큰을 넘습니다. "
                    "새 대화를 시작하거나 더 짧게 보내 주세요.",
        "deleted_mid_reply": "답변을 쓰는 중에 이 대화가 삭제되어 답변을 멈췄습니다.",
        "busy": "지금 어시스턴트가 매우 바빠 메시지를 받지 못했습니다. 입력창에 그대로 있으니 잠시 후 다시 시도해 "
                "주세요.",
        "too_many": "다른 대화에서 답변을 쓰는 중입니다. 하나가 끝난 뒤 다시 보내 주세요.",
        "unavailable": "지금은 어시스턴트를 사용할 수 없어 메시지를 보내지 못했습니다. 입력창에 그대로 있으니 잠시 후 "
                       "다시 시도하거나 상담원 연결을 눌러 주세요.",
        "unavailable_alone": "지금은 어시스턴트를 사용할 수 없어 메시지를 보내지 못했습니다. 입력창에 그대로 있으니 잠시 "
                             "후 다시 시도해 주세요.",
        "reply_cut": "문제가 생겨 답변이 중간에 끊겼습니다. 쓰인 부분은 남아 있으니 다시 보내면 이어집니다.",
        "reply_cut_storage": "지금 대화를 저장할 수 없어 답변이 중간에 끊겼습니다. 잠시 후 다시 시도해 주세요.",
    },
}

I18N = gr.I18n(**TEXT)

# What a customer types to ask for a person (lowercased, contained anywhere in the message).
PERSON_PHRASES = ("talk to a person", "talk to a human", "speak to a person", "speak to a human", "real person",
                  "human agent", "live agent", "talk to someone", "상담원 연결", "상담원이랑", "상담사 연결",
                  "사람이랑 얘기", "사람과 이야기", "직원 연결")


def wants_person(text: str) -> bool:
    folded = " ".join(text.lower().split())
    return any(phrase in folded for phrase in PERSON_PHRASES)


def text(key: str):
    """A component's text, translated in the browser."""
    return I18N(key)


def language(request) -> str:
    """The customer's language: the page switch's cookie, else the browser's first Accept-Language."""
    cookies = getattr(request, "cookies", None) or {}
    if cookies.get(LANG_COOKIE) in LANGUAGES:
        return cookies[LANG_COOKIE]
    headers = getattr(request, "headers", None) or {}
    accept = (headers.get("accept-language") or "").lower()
    return "ko" if accept.startswith("ko") else "en"


def say(request, key: str, **values) -> str:
    return SAID[language(request)][key].format(**values)


class Refusal(ValueError):
    """A turn refused for a reason the customer is told in their language (a SAID key and its
    values); str() is the English line, for logs and the demo page."""

    def __init__(self, key: str, **values) -> None:
        super().__init__(SAID["en"][key].format(**values))
        self.key, self.values = key, values


# The page's language switch: a cookie for a year, then the page again in the other language.
SWITCH_JS = f"""() => {{
  const now = (document.cookie.match(/{LANG_COOKIE}=(\\w+)/) || [])[1]
    || (navigator.language.startsWith('ko') ? 'ko' : 'en');
  document.cookie = '{LANG_COOKIE}=' + (now === 'ko' ? 'en' : 'ko') + '; path=/; max-age=31536000; samesite=lax';
  location.reload();
}}"""
