package namelist

import (
	"slices"
	"testing"
)

// TestHead: up to n names, sorted, and ", ..." only past n; the caller's
// slice is not reordered.
func TestHead(t *testing.T) {
	for _, tc := range []struct {
		names []string
		n     int
		want  string
	}{
		{nil, 3, ""},
		{[]string{}, 3, ""},
		{[]string{"b"}, 3, "b"},
		{[]string{"c", "a", "b"}, 3, "a, b, c"},           // n names: no ellipsis
		{[]string{"d", "c", "a", "b"}, 3, "a, b, c, ..."}, // n+1: the first n sorted
		{[]string{"e", "d", "c", "b", "a", "f"}, 5, "a, b, c, d, e, ..."},
		{[]string{"b", "a"}, 1, "a, ..."},
		{[]string{"B", "a", "A"}, 3, "A, B, a"}, // byte order, as sort.Strings
	} {
		orig := slices.Clone(tc.names)
		if got := Head(tc.names, tc.n); got != tc.want {
			t.Errorf("Head(%q, %d) = %q, want %q", tc.names, tc.n, got, tc.want)
		}
		if !slices.Equal(tc.names, orig) {
			t.Errorf("Head(%q, %d) reordered its argument to %q", orig, tc.n, tc.names)
		}
	}
}
