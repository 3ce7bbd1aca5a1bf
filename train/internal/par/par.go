// Package par splits row-parallel loops over cpu.Threads goroutines.
package par

import (
	"sync"

	"distill/compute/cpu"
)

// Workers is the number of worker slots Rows may use (its w argument is
// below it), for callers that keep per-worker partial sums.
func Workers() int { return max(cpu.Threads, 1) }

// Rows runs fn over [0,n) split into at most Workers() contiguous ranges,
// inline when n·costPerRow is too small to pay for goroutines.
func Rows(n, costPerRow int, fn func(w, lo, hi int)) {
	t := min(Workers(), n)
	if t <= 1 || n*costPerRow < 1<<14 {
		if n > 0 {
			fn(0, 0, n)
		}
		return
	}
	var wg sync.WaitGroup
	for w := 0; w < t; w++ {
		wg.Add(1)
		go func(w, lo, hi int) {
			defer wg.Done()
			fn(w, lo, hi)
		}(w, n*w/t, n*(w+1)/t)
	}
	wg.Wait()
}
