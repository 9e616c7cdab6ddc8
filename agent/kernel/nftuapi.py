"""nf_tables numbers, named as the kernel's uapi names them (include/uapi/linux/netfilter/
nf_tables.h unless a line says otherwise), so each line can be checked against the header.

Only what the table reader (agent/kernel/nftread.py and its decoders) reads or asks for;
an attribute's number is its place in its enum (the enum's UNSPEC is 0)."""
from __future__ import annotations

# linux/netfilter.h: NFPROTO_*
FAMILIES = {"unspec": 0, "inet": 1, "ip": 2, "arp": 3, "netdev": 5, "bridge": 7, "ip6": 10}
FAMILY_NAMES = {v: k for k, v in FAMILIES.items()}

# enum nf_tables_msg_types
NFT_MSG_NEWTABLE, NFT_MSG_GETTABLE, NFT_MSG_DELTABLE = 0, 1, 2
NFT_MSG_NEWCHAIN, NFT_MSG_GETCHAIN, NFT_MSG_DELCHAIN = 3, 4, 5
NFT_MSG_NEWRULE, NFT_MSG_GETRULE, NFT_MSG_DELRULE = 6, 7, 8
NFT_MSG_NEWSET, NFT_MSG_GETSET, NFT_MSG_DELSET = 9, 10, 11
NFT_MSG_NEWSETELEM, NFT_MSG_GETSETELEM, NFT_MSG_DELSETELEM = 12, 13, 14
NFT_MSG_NEWGEN, NFT_MSG_GETGEN = 15, 16

# --- object attributes ------------------------------------------------------------------
# enum nft_table_attributes
NFTA_TABLE_NAME = 1
# enum nft_chain_attributes
NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME, NFTA_CHAIN_HOOK = 1, 3, 4
NFTA_CHAIN_POLICY, NFTA_CHAIN_TYPE, NFTA_CHAIN_FLAGS = 5, 7, 10
# enum nft_hook_attributes
NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY = 1, 2
# enum nft_rule_attributes
NFTA_RULE_TABLE, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS, NFTA_RULE_USERDATA = 1, 2, 4, 7
# enum nft_set_attributes
NFTA_SET_TABLE, NFTA_SET_NAME, NFTA_SET_FLAGS, NFTA_SET_KEY_TYPE, NFTA_SET_KEY_LEN = 1, 2, 3, 4, 5
NFTA_SET_DATA_TYPE, NFTA_SET_DATA_LEN, NFTA_SET_DESC = 6, 7, 9
NFTA_SET_USERDATA, NFTA_SET_OBJ_TYPE, NFTA_SET_HANDLE = 13, 15, 16
NFTA_SET_EXPR, NFTA_SET_EXPRESSIONS = 17, 18
# enum nft_set_desc_attributes
NFTA_SET_DESC_SIZE = 1
# enum nft_set_elem_list_attributes
NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_ELEMENTS = 1, 2, 3
# enum nft_set_elem_attributes
NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_FLAGS, NFTA_SET_ELEM_TIMEOUT = 1, 2, 3, 4
NFTA_SET_ELEM_EXPIRATION, NFTA_SET_ELEM_USERDATA, NFTA_SET_ELEM_EXPR = 5, 6, 7
NFTA_SET_ELEM_OBJREF, NFTA_SET_ELEM_KEY_END, NFTA_SET_ELEM_EXPRESSIONS = 9, 10, 11
# enum nft_list_attributes
NFTA_LIST_ELEM = 1
# enum nft_data_attributes, enum nft_verdict_attributes
NFTA_DATA_VALUE, NFTA_DATA_VERDICT = 1, 2
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
# enum nft_expr_attributes
NFTA_EXPR_NAME, NFTA_EXPR_DATA = 1, 2
# enum nft_gen_attributes
NFTA_GEN_ID = 1

# --- expression attributes (the decompiler's vocabulary) ---------------------------------
# enum nft_payload_attributes
NFTA_PAYLOAD_DREG, NFTA_PAYLOAD_BASE, NFTA_PAYLOAD_OFFSET, NFTA_PAYLOAD_LEN, NFTA_PAYLOAD_SREG = 1, 2, 3, 4, 5
# enum nft_meta_attributes
NFTA_META_DREG, NFTA_META_KEY, NFTA_META_SREG = 1, 2, 3
# enum nft_bitwise_attributes
NFTA_BITWISE_SREG, NFTA_BITWISE_DREG, NFTA_BITWISE_LEN, NFTA_BITWISE_MASK, NFTA_BITWISE_XOR = 1, 2, 3, 4, 5
NFTA_BITWISE_OP = 6
# enum nft_ct_attributes
NFTA_CT_DREG, NFTA_CT_KEY, NFTA_CT_DIRECTION, NFTA_CT_SREG = 1, 2, 3, 4
# enum nft_ng_attributes
NFTA_NG_DREG, NFTA_NG_MODULUS, NFTA_NG_TYPE, NFTA_NG_OFFSET = 1, 2, 3, 4
# enum nft_hash_attributes, enum nft_hash_types
NFTA_HASH_SREG, NFTA_HASH_DREG, NFTA_HASH_LEN, NFTA_HASH_MODULUS, NFTA_HASH_SEED = 1, 2, 3, 4, 5
NFTA_HASH_OFFSET, NFTA_HASH_TYPE, NFTA_HASH_SET_NAME, NFTA_HASH_SET_ID = 6, 7, 8, 9
NFT_HASH_JENKINS = 0
# enum nft_immediate_attributes
NFTA_IMMEDIATE_DREG, NFTA_IMMEDIATE_DATA = 1, 2
# enum nft_cmp_attributes
NFTA_CMP_SREG, NFTA_CMP_OP, NFTA_CMP_DATA = 1, 2, 3
# enum nft_lookup_attributes
NFTA_LOOKUP_SET, NFTA_LOOKUP_SREG, NFTA_LOOKUP_DREG, NFTA_LOOKUP_FLAGS = 1, 2, 3, 5
# enum nft_nat_attributes
NFTA_NAT_TYPE, NFTA_NAT_FAMILY, NFTA_NAT_REG_ADDR_MIN, NFTA_NAT_REG_ADDR_MAX = 1, 2, 3, 4
NFTA_NAT_REG_PROTO_MIN, NFTA_NAT_REG_PROTO_MAX, NFTA_NAT_FLAGS = 5, 6, 7
# enum nft_masq_attributes
NFTA_MASQ_FLAGS, NFTA_MASQ_REG_PROTO_MIN, NFTA_MASQ_REG_PROTO_MAX = 1, 2, 3
# enum nft_dynset_attributes
NFTA_DYNSET_SET_NAME, NFTA_DYNSET_OP, NFTA_DYNSET_SREG_KEY, NFTA_DYNSET_SREG_DATA = 1, 3, 4, 5
NFTA_DYNSET_TIMEOUT, NFTA_DYNSET_EXPR, NFTA_DYNSET_FLAGS, NFTA_DYNSET_EXPRESSIONS = 6, 7, 9, 10
# enum nft_counter_attributes
NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS = 1, 2

# --- values -----------------------------------------------------------------------------
# enum nft_set_flags
NFT_SET_ANONYMOUS, NFT_SET_CONSTANT, NFT_SET_INTERVAL, NFT_SET_MAP = 0x1, 0x2, 0x4, 0x8
NFT_SET_TIMEOUT, NFT_SET_EVAL, NFT_SET_OBJECT = 0x10, 0x20, 0x40
# enum nft_set_elem_flags
NFT_SET_ELEM_INTERVAL_END, NFT_SET_ELEM_CATCHALL = 0x1, 0x2
# enum nft_chain_flags
NFT_CHAIN_BINDING = 0x4
# NFT_DATA_VERDICT: the type id of verdict data (NFT_DATA_RESERVED_MASK)
NFT_DATA_VERDICT = 0xFFFFFF00
# enum nft_registers
NFT_REG_VERDICT = 0
# enum nft_payload_bases
NFT_PAYLOAD_NETWORK_HEADER, NFT_PAYLOAD_TRANSPORT_HEADER = 1, 2
# enum nft_meta_keys
NFT_META_MARK, NFT_META_IIFNAME, NFT_META_OIFNAME, NFT_META_L4PROTO = 3, 6, 7, 16
# enum nft_ct_keys
NFT_CT_MARK, NFT_CT_SRC_IP, NFT_CT_DST_IP = 3, 19, 20
# enum nft_lookup_flags
NFT_LOOKUP_F_INV = 0x1
# enum nft_nat_types
NFT_NAT_SNAT, NFT_NAT_DNAT = 0, 1
# linux/netfilter/nf_nat.h: NF_NAT_RANGE_*
NF_NAT_RANGE_MAP_IPS, NF_NAT_RANGE_PROTO_SPECIFIED, NF_NAT_RANGE_PROTO_RANDOM_FULLY = 0x1, 0x2, 0x10

# libnftnl's include/libnftnl/udata.h (userdata TLVs nft writes; the kernel keeps them opaque)
NFTNL_UDATA_SET_KEYBYTEORDER, NFTNL_UDATA_SET_DATABYTEORDER = 0, 1
NFTNL_UDATA_SET_ELEM_COMMENT = 0
NFTNL_UDATA_RULE_COMMENT = 0
BYTEORDER_HOST_ENDIAN = 1  # nftables' enum byteorder
