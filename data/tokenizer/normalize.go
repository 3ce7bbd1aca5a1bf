package tokenizer

import (
	"golang.org/x/text/unicode/norm"
)

// normalizeNFC returns NFC(s) and, when it differs from s, an alignment:
// align[j] is the [start,end) byte range of s that produced byte j of the
// result. Unchanged stretches map byte to byte; a changed normalization
// segment (a starter and its combining marks) maps every output byte to the
// whole input segment, since its bytes have no finer correspondence. When s
// is already NFC (the common case) align is nil and nothing is allocated.
func normalizeNFC(s string) (string, [][2]int) {
	if norm.NFC.QuickSpanString(s) == len(s) {
		return s, nil
	}
	var it norm.Iter
	it.InitString(norm.NFC, s)
	out := make([]byte, 0, len(s)+8)
	align := make([][2]int, 0, len(s)+8)
	pos := 0
	for !it.Done() {
		seg := it.Next()
		end := it.Pos()
		if string(seg) == s[pos:end] {
			for k := pos; k < end; k++ {
				align = append(align, [2]int{k, k + 1})
			}
		} else {
			for range seg {
				align = append(align, [2]int{pos, end})
			}
		}
		out = append(out, seg...)
		pos = end
	}
	return string(out), align
}
