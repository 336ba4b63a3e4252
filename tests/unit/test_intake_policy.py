"""IntakePolicy configuration and the default address policy (checked as logic: no traffic)."""

from __future__ import annotations

import ipaddress

import pytest

from llava.errors import ImageSourceNotAllowed
from llava.intake import IntakePolicy
from llava.intake.netpolicy import AddressGuard, refusal_reason

REFUSED = {
    "127.0.0.1": "loopback",
    "127.255.255.254": "loopback",
    "10.0.0.5": "private",
    "172.16.0.1": "private",
    "192.168.1.1": "private",
    "169.254.169.254": "link-local",  # instance metadata service
    "100.64.0.1": "non-public",  # carrier-grade NAT
    "0.0.0.0": "unspecified",
    "224.0.0.1": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "reserved",
    "::1": "loopback",
    "::": "unspecified",
    "fe80::1": "link-local",
    "fc00::1": "private",
    "fd00:ec2::254": "private",  # instance metadata service over IPv6
    "ff02::1": "multicast",
    "::ffff:127.0.0.1": "loopback",  # IPv4-mapped
    "::ffff:169.254.169.254": "link-local",
    "2002:a9fe:a9fe::1": "link-local",  # 6to4 of 169.254.169.254
    "64:ff9b::a9fe:a9fe": "link-local",  # NAT64 of 169.254.169.254
}
PUBLIC = ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize(("address", "reason"), REFUSED.items())
def test_default_policy_refuses_non_public_addresses(address, reason):
    ip = ipaddress.ip_address(address)
    assert refusal_reason(ip) == reason
    with pytest.raises(ImageSourceNotAllowed, match=rf"{reason} address.*intake\.allow"):
        AddressGuard(IntakePolicy()).check("images.example.com", ip)


@pytest.mark.parametrize("address", PUBLIC)
def test_default_policy_allows_public_addresses(address):
    ip = ipaddress.ip_address(address)
    assert refusal_reason(ip) is None
    AddressGuard(IntakePolicy()).check("images.example.com", ip)


def test_allow_opens_addresses_networks_and_host_names():
    guard = AddressGuard(IntakePolicy(allow=("10.0.0.0/8", "127.0.0.1", "Images.Internal")))
    guard.check("x", ipaddress.ip_address("10.1.2.3"))
    guard.check("x", ipaddress.ip_address("127.0.0.1"))
    guard.check("images.internal.", ipaddress.ip_address("192.168.0.9"))
    for address in ("127.0.0.2", "192.168.0.9", "169.254.169.254"):
        with pytest.raises(ImageSourceNotAllowed):
            guard.check("x", ipaddress.ip_address(address))


def test_from_mapping_normalises_and_validates():
    policy = IntakePolicy.from_mapping(
        {"formats": ["png", "jpeg"], "schemes": ["HTTPS"], "allow": [" 10.0.0.0/8 "]}
    )
    assert policy.formats == {"PNG", "JPEG"}
    assert policy.schemes == {"https"}
    assert policy.allow == ("10.0.0.0/8",)
    assert IntakePolicy.from_mapping({}) == IntakePolicy()


@pytest.mark.parametrize(
    "values",
    [
        {"max_byte": 10},
        {"max_bytes": 0},
        {"max_pixels": 1.5},
        {"deadline_s": -1},
        {"max_redirects": -1},
        {"formats": ["PNG", "PDF"]},
        {"formats": []},
        {"formats": "PNG"},
        {"schemes": ["file"]},
        {"allow": ["not a host!"]},
    ],
)
def test_from_mapping_refuses_bad_config(values):
    with pytest.raises(ValueError, match="intake"):
        IntakePolicy.from_mapping(values)
