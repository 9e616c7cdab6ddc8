"""The golden files' own comparison: by meaning, as every nftables the agent meets prints it."""
from tests.golden import nft_text_by_meaning


def test_golden_listings_compare_by_meaning_not_by_element_order() -> None:
    a = 'map m {\n\telements = { 1 . tcp comment "x,y" : goto a,\n\t\t     2 . udp : goto b }\n}\n'
    b = 'map m {\n\telements = { 2 . udp : goto b, 1 . tcp comment "x,y" : goto a }\n}\n'
    assert nft_text_by_meaning(a) == nft_text_by_meaning(b)
    assert nft_text_by_meaning(a) != nft_text_by_meaning(b.replace("goto b", "goto c"))  # a real difference shows
