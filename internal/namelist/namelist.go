// Package namelist formats a list of names for a message a user reads:
// enough of them to recognize what was found (a directory's files), not
// every one of a directory that may hold thousands.
package namelist

import (
	"slices"
	"strings"
)

// Head is the first n (n > 0) of names in sorted order, joined with ", ",
// followed by ", ..." when names holds more than n. Sorted, so that the
// same files give the same message whatever order they were listed in.
// names itself is left as it was.
func Head(names []string, n int) string {
	sorted := slices.Sorted(slices.Values(names))
	if len(sorted) <= n {
		return strings.Join(sorted, ", ")
	}
	return strings.Join(sorted[:n], ", ") + ", ..."
}
