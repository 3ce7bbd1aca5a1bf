//go:build !race

package trainer

// raceDetector is whether this test binary runs under the race detector.
const raceDetector = false
