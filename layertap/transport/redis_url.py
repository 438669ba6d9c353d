"""Redis URLs: the one home of their forms, how a ``sentinel://`` URL is read, and how any of them
is printed without its passwords.

Forms layertap takes (``LAYERTAP_REDIS_URL``):

* ``redis://[[user]:password@]host[:port][/db][?query]`` and ``rediss://`` (TLS): read by
  redis-py's ``from_url`` and kombu as they are, one address each;
* ``sentinel://[[user]:password@]host[:port][/db]?master_name=NAME`` with more sentinels joined by
  ``;`` (``sentinel://h1:26379;sentinel://h2:26379;sentinel://h3:26379/0?master_name=NAME``):
  Celery's broker and result backend URL for Sentinel, with the settings Celery takes as
  transport options (``master_name``, the sentinels' own ``password``, TLS) as query parameters,
  so one string says everything (:class:`SentinelUrl`).

Invariants: :func:`redacted_url` never raises and leaves no password in its output, of those
forms nor of any other redis-py and kombu read (``unix://``, ``?password=``, ``;``-joined
alternates, a sentinel-style ``h1:26379;h2``); :func:`parse_sentinel_url` gives the sentinels
in the order written and refuses what it cannot read (the message names no password).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlsplit

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
ADDRESS_SEPARATOR = ";"  # kombu's and Celery's: several addresses in one URL
REDACTED = "***"
#: Query parameters of a ``sentinel://`` URL that layertap reads (and hands on as Celery's
#: transport options): the primary's name, the sentinels' password, TLS to the primary and the sentinels.
SENTINEL_PARAMS = ("master_name", "sentinel_password", "ssl")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclass(frozen=True)
class SentinelUrl:
    """A ``sentinel://`` URL, read: the sentinels to ask (in order), the primary's name, and how
    to log in to the primary (``username``, ``password``, ``db``) and to the sentinels."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    username: str | None = None
    password: str | None = None
    db: int = 0
    sentinel_password: str | None = None
    ssl: bool = False

    def address_url(self, index: int) -> str:
        """Sentinel ``index`` as a Celery ``sentinel://`` address, with the primary's login and db."""
        host, port = self.sentinels[index]
        login = ""
        if self.username is not None or self.password is not None:
            login = quote(self.username or "", safe="")
            login += (":" + quote(self.password, safe="")) if self.password is not None else ""
            login += "@"
        host = f"[{host}]" if ":" in host else host
        return f"{SENTINEL_SCHEME}://{login}{host}:{port}/{self.db}"

    def celery_url(self) -> str:
        """Every sentinel as Celery's result backend reads them (``;``-joined addresses)."""
        return ADDRESS_SEPARATOR.join(self.address_url(index) for index in range(len(self.sentinels)))


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` is a ``sentinel://`` URL."""
    return url.split("://", 1)[0].strip().lower() == SENTINEL_SCHEME


def uses_tls(url: str) -> bool:
    """Whether connections for ``url`` use TLS: ``rediss://``, or ``sentinel://...?ssl=true``."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).ssl
    return url.split("://", 1)[0].strip().lower() == "rediss"


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Read a ``sentinel://`` URL (module doc). The login, db and parameters may be written on
    any of its addresses, but the same wherever written. Raises ``ValueError``."""
    where = f"Redis URL {redacted_url(url)}"
    sentinels: list[tuple[str, int]] = []
    found: dict[str, str] = {}

    def note(name: str, value: str | None) -> None:
        if value is None:
            return
        if found.setdefault(name, value) != value:
            raise ValueError(f"{where}: its addresses give different values of {name}")

    for address in url.split(ADDRESS_SEPARATOR):
        if not is_sentinel_url(address):
            raise ValueError(f"{where}: every address needs its own sentinel:// (address;sentinel://host:port;...)")
        try:
            parts = urlsplit(address.strip())
            port = parts.port or SENTINEL_PORT
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not parts.hostname:
            raise ValueError(f"{where}: an address without a host")
        sentinels.append((parts.hostname, port))
        note("username", unquote(parts.username) if parts.username else None)
        note("password", unquote(parts.password) if parts.password is not None else None)
        note("db", parts.path.strip("/") or None)
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in SENTINEL_PARAMS:
                raise ValueError(f"{where}: unknown parameter {name!r} (known: {', '.join(SENTINEL_PARAMS)})")
            note(name, value)
    if not found.get("master_name"):
        raise ValueError(f"{where}: no master_name (add ?master_name=<the name the sentinels monitor>)")
    db = found.get("db", "0")
    if not db.isdigit():
        raise ValueError(f"{where}: the database must be a number, not {db!r}")
    ssl = found.get("ssl", "false").lower()
    if ssl not in _TRUE + _FALSE:
        raise ValueError(f"{where}: ssl must be true or false, not {ssl!r}")
    return SentinelUrl(sentinels=tuple(sentinels), master_name=found["master_name"],
                       username=found.get("username"), password=found.get("password"), db=int(db),
                       sentinel_password=found.get("sentinel_password"), ssl=ssl in _TRUE)


def check_redis_url(url: str) -> None:
    """Raise ``ValueError`` for a URL layertap cannot use: a ``sentinel://`` one it cannot read,
    or several addresses joined by ``;`` that are not sentinels (failover needs Sentinel)."""
    if is_sentinel_url(url):
        parse_sentinel_url(url)
    elif ADDRESS_SEPARATOR in url:
        raise ValueError(f"Redis URL {redacted_url(url)}: several addresses need sentinel:// "
                         "(sentinel://h1:26379;sentinel://h2:26379/0?master_name=NAME); one redis:// address otherwise")


def redacted_url(url: str) -> str:
    """``url`` with every password in it replaced by ``***``: in each ``;``-joined address, the
    password of its ``user:password@`` part and every query parameter whose name ends in
    ``password`` (redis-py's ``password``, ``ssl_password``; ``sentinel_password``). Never raises;
    a form it cannot tell apart is redacted too much rather than too little. Use it wherever a
    URL is printed or logged."""
    addresses: list[str] = []
    for address in url.split(ADDRESS_SEPARATOR):
        if addresses and "://" not in address and "@" in address and "@" not in addresses[-1]:
            addresses[-1] += ADDRESS_SEPARATOR + address  # a ";" inside a password: one address
        else:
            addresses.append(address)
    return ADDRESS_SEPARATOR.join(_redacted_address(address) for address in addresses)


def _redacted_address(address: str) -> str:
    scheme, separator, rest = address.partition("://")
    if not separator:
        scheme, rest = "", address
    query_at = rest.find("?")
    at = rest.rfind("@", 0, query_at if query_at >= 0 else len(rest))
    if at < 0:
        at = rest.rfind("@")  # a password with an unencoded "?" in it
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        rest = (f"{user}:{REDACTED}" if colon else rest[:at]) + rest[at:]
    body, question, query = rest.partition("?")
    if question:
        fields = []
        for field in query.split("&"):
            name, equals, _ = field.partition("=")
            secret = equals and unquote(name).strip().lower().endswith("password")
            fields.append(f"{name}={REDACTED}" if secret else field)
        rest = body + "?" + "&".join(fields)
    return scheme + separator + rest
