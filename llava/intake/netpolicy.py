"""Which network addresses an image fetch may connect to.

By default only globally routable unicast addresses: loopback, private, link-local (the
instance metadata service at 169.254.169.254 hands out credentials), shared, multicast,
reserved and unspecified addresses are refused, also when wrapped in IPv6 (IPv4-mapped, 6to4,
NAT64). ``IntakePolicy.allow`` opens addresses, networks or host names.

``AddressGuard.resolve`` is called by the connection itself (see ``transport``), and the
connection goes to the address it returned: the name is resolved once per connection, so a
DNS answer that changes between a check and the connect (DNS rebinding) cannot slip through.
"""

from __future__ import annotations

import ipaddress
import socket

from llava.errors import ImageFetchFailed, ImageSourceNotAllowed

from .policy import IntakePolicy

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CATEGORIES = (  # checked in order: the first match names the refusal
    ("unspecified", "is_unspecified"),
    ("loopback", "is_loopback"),
    ("link-local", "is_link_local"),
    ("multicast", "is_multicast"),
    ("reserved", "is_reserved"),
    ("private", "is_private"),
    ("site-local", "is_site_local"),
)


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries and would reach, if any."""
    if ip.version == 4:
        return None
    if ip.ipv4_mapped or ip.sixtofour:
        return ip.ipv4_mapped or ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def refusal_reason(ip: IPAddress) -> str | None:
    """Why the default policy refuses ``ip`` ("loopback", "private"...), or None if public."""
    ip = embedded_ipv4(ip) or ip
    for name, attribute in _CATEGORIES:
        if getattr(ip, attribute, False):
            return name
    return None if ip.is_global else "non-public"


class AddressGuard:
    """The address policy of one ``IntakePolicy``: allowlist first, then the default rules."""

    def __init__(self, policy: IntakePolicy):
        self._hosts = set()
        self._networks = []
        for entry in policy.allow:
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._hosts.add(entry.lower().rstrip("."))

    def check(self, host: str, ip: IPAddress) -> None:
        """Raise ``ImageSourceNotAllowed`` unless a connection to ``ip`` (named ``host``) is ok."""
        if host.lower().rstrip(".") in self._hosts:
            return
        if any(ip in network for network in self._networks if network.version == ip.version):
            return
        reason = refusal_reason(ip)
        if reason is not None:
            what = f"{ip} is" if host == str(ip) else f"host {host} resolves to {ip},"
            raise ImageSourceNotAllowed(
                f"{what} a {reason} address, refused by default; "
                f"add it to intake.allow to permit it"
            )

    def resolve(self, host: str, port: int) -> str:
        """Resolve ``host`` once and return the first permitted address.

        Refuses when no address is permitted, naming the first one.
        """
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ImageFetchFailed(f"cannot resolve host {host} ({e}); check the URL") from e
        first_refusal = None
        for *_, sockaddr in infos:
            try:
                self.check(host, ipaddress.ip_address(sockaddr[0]))
            except ImageSourceNotAllowed as e:
                first_refusal = first_refusal or e
                continue
            return sockaddr[0]
        raise first_refusal or ImageFetchFailed(f"host {host} has no address; check the URL")
