"""The shop's orders, which the built-in tool lookup_order reads. A new database gets sample orders
(numbers as the default assistant's policies give them: NW and eight digits), so a new user can ask
"Where is my order NW20481377? dana@example.com" and see it answered from data; a shop loads its own
rows instead (`python -m storage.orders import orders.csv`).

An order's details go to the model only once the customer has written, in the same chat, the e-mail
address it was placed with: order numbers are sequential, so a number alone would let anyone read
another customer's items and tracking. Without that address the model is told to ask for it, in the
same words whether the number exists or not (no oracle for guessing numbers). An order stored without
an e-mail address is told to anyone with its number (the shop's choice, by leaving the column out)."""
from __future__ import annotations

import argparse
import csv
import re

ORDER_ID = re.compile(r"\b[A-Z]{2}-?\d{8}\b", re.I)  # any shop's two letters: a wrong prefix is looked up, not found
EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
FIELDS = ("order_id", "email", "status", "items", "carrier", "tracking", "placed", "delivery")
SAMPLE = [
    ("NW20481377", "dana@example.com", "shipped", "2-person tent (green)", "UPS", "1Z999AA10123456784", "2026-11-27",
     "expected 2026-12-04"),
    ("NW20481378", "lee@example.com", "processing", "Rain jacket (M), wool socks x2", "", "", "2026-12-02",
     "ships within two business days"),
    ("NW20481379", "kim@example.com", "delivered", "Blue hiking backpack 40 L", "USPS", "9400111899562537866360",
     "2026-11-18", "delivered 2026-11-22"),
    ("NW20481380", "ari@example.com", "returned", "Sleeping bag -5 C", "UPS", "1Z999AA10123456791", "2026-11-02",
     "refund issued 2026-11-20"),
    ("NW20481381", "sam@example.com", "delayed", "Camping stove, 2 gas canisters", "FedEx", "771234567890",
     "2026-11-25", "carrier delay, now expected 2026-12-06"),
    ("NW12345678", "jo@example.com", "shipped", "Trekking poles (pair)", "UPS", "1Z999AA10123456800", "2026-11-30",
     "expected 2026-12-05"),
]


def normalise(order_id: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", str(order_id).upper())


def seed_sample(store) -> int:
    """Sample orders into an empty orders table; returns how many were added."""
    with store._db() as db:
        if db["orders"].count:
            return 0
        db["orders"].insert_all([dict(zip(FIELDS, row)) for row in SAMPLE], pk="order_id")
    return len(SAMPLE)


def lookup(store, order_id: str) -> dict | None:
    """One order, its customer's e-mail address included, or None."""
    with store._db() as db:
        rows = list(db["orders"].rows_where("order_id = ?", [normalise(order_id)]))
    return rows[0] if rows else None


def answer(store, order_id: str, said: str) -> str:
    """What lookup_order tells the model about `order_id`, given all the customer has written in this
    chat (`said`): the order, if they wrote the address it was placed with (or it has none)."""
    number, order = normalise(order_id), lookup(store, order_id)
    emails = {e.lower().rstrip(".") for e in EMAIL.findall(said or "")}
    if order is not None and (not order.get("email") or order["email"].strip().lower() in emails):
        return describe({k: v for k, v in order.items() if k != "email" and v})
    if not emails:
        return (f"Order {number} can be looked up once the customer gives the e-mail address it was placed with: "
                "ask them for it.")
    return (f"No order {number} was placed with the e-mail address the customer gave: ask them to check the order "
            "number and the address.")


def describe(order: dict) -> str:
    """An order as plain sentences: small models repeat these more faithfully than JSON."""
    parts = [f"Order {order['order_id']} is {order['status']}."]
    if order.get("items"):
        parts.append(f"Items: {order['items']}.")
    if order.get("carrier"):
        parts.append(f"Carrier: {order['carrier']}, tracking number {order.get('tracking') or 'not yet known'}.")
    if order.get("delivery"):
        parts.append(f"Delivery: {order['delivery']}.")
    return " ".join(parts)


def import_csv(store, path: str) -> int:
    """Rows of a CSV with the FIELDS as its header, inserted or replaced in one transaction."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    missing = [name for name in ("order_id", "status") if rows and name not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{path}: needs a header with at least order_id and status (known: {', '.join(FIELDS)})")
    with store._db() as db:
        db["orders"].upsert_all([{k: (normalise(v) if k == "order_id" else v) for k, v in row.items() if k in FIELDS}
                                 for row in rows], pk="order_id")
    return len(rows)


def main() -> None:
    from storage import Store

    p = argparse.ArgumentParser(description="Load the shop's orders (lookup_order reads them).")
    p.add_argument("command", choices=["import"])
    p.add_argument("csv")
    p.add_argument("--db", default="pagedchat.db")
    args = p.parse_args()
    print(f"{import_csv(Store(args.db), args.csv)} orders loaded into {args.db}")


if __name__ == "__main__":
    main()
