"""slime.utils: the helpers slime's plugins import (mirrors slime's slime/utils/, which has no exports of its own)."""
