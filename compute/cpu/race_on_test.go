//go:build race

package cpu

// raceDetector is whether this test binary runs under the race detector.
const raceDetector = true
