// Package suggest finds the name a user most likely meant when they
// mistyped one (a config key, a flag, a command): "did you mean ...?".
package suggest

// Closest is the candidate nearest to name by edit distance (insertions,
// deletions, substitutions and transpositions of adjacent characters),
// or "" when none is near enough to be a typo of it: at most 1 edit, plus
// 1 for every 4 characters of name. Ties go to the earlier candidate.
func Closest(name string, candidates []string) string {
	best, bestD := "", 1+len(name)/4+1
	for _, c := range candidates {
		if d := distance(name, c); d < bestD && c != name {
			best, bestD = c, d
		}
	}
	return best
}

// distance is the optimal string alignment distance between a and b.
func distance(a, b string) int {
	// d[i][j] is the distance between a[:i] and b[:j].
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}
