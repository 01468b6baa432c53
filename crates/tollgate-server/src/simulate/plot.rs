//! A plot of a simulation's timeline as SVG: requests per interval, and each policy's
//! rejections (solid) and would-be rejections of its shadow limits (dashed), on one time axis.
//!
//! Written by hand: a chart of a few lines is a page of text, and a file any browser opens
//! needs no plotting library, no fonts and no system packages. A long timeline is summed into
//! at most [`MAX_POINTS`] points (an axis of a thousand pixels shows no more), and the title
//! says how long each point is.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use tollgate_policy::UnixTime;

use super::tally::Slot;

/// The most points a line has.
pub(crate) const MAX_POINTS: u64 = 1_000;

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 50.0;

/// Line colours of the policies, in order (then again).
const COLOURS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// One policy's timeline.
pub(crate) struct Series<'a> {
    /// The policy, as the legend names it.
    pub(crate) label: &'a str,
    /// Its requests by interval index (as [`super::tally::Tally::timeline`]).
    pub(crate) timeline: &'a BTreeMap<u64, Slot>,
}

/// The SVG document of `series` on intervals of `interval`.
pub(crate) fn svg(series: &[Series<'_>], interval: Duration) -> String {
    let first = series
        .iter()
        .filter_map(|s| s.timeline.first_key_value().map(|(k, _)| *k))
        .min();
    let last = series
        .iter()
        .filter_map(|s| s.timeline.last_key_value().map(|(k, _)| *k))
        .max();
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    out.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
    out.push('\n');
    let (Some(first), Some(last)) = (first, last) else {
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">no requests</text></svg>"#,
            WIDTH / 2.0,
            HEIGHT / 2.0
        );
        return out;
    };
    let per_point = (last - first) / MAX_POINTS + 1;
    let points = (last - first) / per_point + 1;
    let binned: Vec<Vec<Slot>> = series
        .iter()
        .map(|s| bin(s.timeline, first, per_point, points))
        .collect();
    let peak = binned
        .iter()
        .flatten()
        .map(|slot| slot.requests)
        .max()
        .unwrap_or(0);
    let top = nice_ceiling(peak);

    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |i: usize| LEFT + plot_w * i as f64 / (points.max(2) - 1) as f64;
    let y = |v: u64| TOP + plot_h - plot_h * v as f64 / top as f64;

    let point_len = interval.saturating_mul(u32::try_from(per_point).unwrap_or(u32::MAX));
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="24" font-size="15">requests and rejections per {}</text>"#,
        human(point_len)
    );
    // Axes and the y scale.
    let _ = writeln!(
        out,
        r##"<g stroke="#888"><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{b}"/><line x1="{LEFT}" y1="{b}" x2="{r}" y2="{b}"/></g>"##,
        b = TOP + plot_h,
        r = LEFT + plot_w,
    );
    for tick in [0, top / 2, top] {
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{ty:.1}" x2="{r}" y2="{ty:.1}" stroke="#eee"/><text x="{tx}" y="{ly:.1}" text-anchor="end">{tick}</text>"##,
            ty = y(tick),
            r = LEFT + plot_w,
            tx = LEFT - 6.0,
            ly = y(tick) + 4.0,
        );
    }
    let interval_ns = u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX);
    let point_ns = interval_ns.saturating_mul(per_point);
    for (at, anchor) in [(0, "start"), (points / 2, "middle"), (points - 1, "end")] {
        let start = first.saturating_mul(interval_ns) + at * point_ns;
        let start = UnixTime::from_nanos(i64::try_from(start).unwrap_or(i64::MAX));
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{}" text-anchor="{anchor}">{}</text>"#,
            x(usize::try_from(at).unwrap_or(0)),
            TOP + plot_h + 20.0,
            start.to_rfc3339()
        );
        if points == 1 {
            break;
        }
    }

    // Requests, as the first policy saw them (the same trace for every policy).
    if let Some(slots) = binned.first() {
        let line = polyline(slots.iter().map(|s| s.requests), &x, &y);
        let _ = writeln!(
            out,
            r##"<polyline points="{line}" fill="none" stroke="#999" stroke-width="1.5"/>"##
        );
    }
    let mut legend = vec![("#999".to_owned(), "requests".to_owned(), false)];
    for (index, (slots, s)) in binned.iter().zip(series).enumerate() {
        let colour = COLOURS[index % COLOURS.len()];
        let rejected = polyline(slots.iter().map(|s| s.rejected), &x, &y);
        let _ = writeln!(
            out,
            r#"<polyline points="{rejected}" fill="none" stroke="{colour}" stroke-width="2"/>"#
        );
        legend.push((colour.to_owned(), format!("rejected: {}", s.label), false));
        if slots.iter().any(|s| s.would_reject > 0) {
            let would = polyline(slots.iter().map(|s| s.would_reject), &x, &y);
            let _ = writeln!(
                out,
                r#"<polyline points="{would}" fill="none" stroke="{colour}" stroke-width="2" stroke-dasharray="6 4"/>"#
            );
            legend.push((
                colour.to_owned(),
                format!("would reject: {}", s.label),
                true,
            ));
        }
    }
    for (row, (colour, label, dashed)) in legend.iter().enumerate() {
        let ly = 40.0 + 16.0 * row as f64;
        let dash = if *dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            out,
            r#"<line x1="{a}" y1="{ly}" x2="{b}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/><text x="{t}" y="{ty}">{}</text>"#,
            escape(label),
            a = WIDTH - 300.0,
            b = WIDTH - 276.0,
            t = WIDTH - 270.0,
            ty = ly + 4.0,
        );
    }
    out.push_str("</svg>\n");
    out
}

/// `timeline` summed into `points` points of `per_point` intervals each, from `first`.
fn bin(timeline: &BTreeMap<u64, Slot>, first: u64, per_point: u64, points: u64) -> Vec<Slot> {
    let mut binned = vec![Slot::default(); usize::try_from(points).unwrap_or(0)];
    for (&index, slot) in timeline.range(first..) {
        let at = usize::try_from((index - first) / per_point).unwrap_or(usize::MAX);
        if let Some(point) = binned.get_mut(at) {
            point.requests += slot.requests;
            point.rejected += slot.rejected;
            point.would_reject += slot.would_reject;
        }
    }
    binned
}

fn polyline(
    values: impl Iterator<Item = u64>,
    x: &impl Fn(usize) -> f64,
    y: &impl Fn(u64) -> f64,
) -> String {
    let mut line = String::new();
    for (i, v) in values.enumerate() {
        let _ = write!(line, "{:.1},{:.1} ", x(i), y(v));
    }
    line.pop();
    line
}

/// The smallest of 1, 2 or 5 times a power of ten that is at least `peak` (1 for 0).
fn nice_ceiling(peak: u64) -> u64 {
    let mut scale = 1u64;
    loop {
        for step in [1, 2, 5] {
            let top = step * scale;
            if top >= peak {
                return top;
            }
        }
        match scale.checked_mul(10) {
            Some(next) if next.checked_mul(5).is_some() => scale = next,
            _ => return peak,
        }
    }
}

/// `1m`, `90s`, `250ms`: the length of a point, for the title.
fn human(length: Duration) -> String {
    let ms = length.as_millis();
    if ms.is_multiple_of(86_400_000) {
        format!("{}d", ms / 86_400_000)
    } else if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(requests: u64, rejected: u64) -> Slot {
        Slot {
            requests,
            rejected,
            would_reject: 0,
        }
    }

    #[test]
    fn scales_to_one_two_or_five() {
        assert_eq!(nice_ceiling(0), 1);
        assert_eq!(nice_ceiling(1), 1);
        assert_eq!(nice_ceiling(3), 5);
        assert_eq!(nice_ceiling(120), 200);
        assert_eq!(nice_ceiling(500), 500);
        assert_eq!(nice_ceiling(u64::MAX), u64::MAX);
    }

    #[test]
    fn sums_a_long_timeline_into_at_most_max_points() {
        let timeline: BTreeMap<u64, Slot> = (0..5_000).map(|i| (1_000 + i, slot(2, 1))).collect();
        let series = [Series {
            label: "a <b>",
            timeline: &timeline,
        }];
        let svg = svg(&series, Duration::from_secs(1));
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("per 5s"), "{svg}");
        assert!(svg.contains("a &lt;b&gt;"));
        let requests = svg.lines().find(|l| l.contains("#999")).unwrap_or_default();
        let points = requests.split(' ').filter(|p| p.contains(',')).count();
        assert!(points <= MAX_POINTS as usize, "{points} points");
        assert_eq!(bin(&timeline, 1_000, 5, 1_000)[0], slot(10, 5));
    }

    #[test]
    fn an_empty_timeline_says_so() {
        let empty = BTreeMap::new();
        let svg = one_policy(&empty, Duration::from_secs(60));
        assert!(svg.contains("no requests"));
    }

    /// The plot of one policy, `p`.
    fn one_policy(timeline: &BTreeMap<u64, Slot>, interval: Duration) -> String {
        svg(
            &[Series {
                label: "p",
                timeline,
            }],
            interval,
        )
    }

    /// The `points` of the polyline whose line holds `marker`.
    fn line_with<'a>(svg: &'a str, marker: &str) -> Vec<&'a str> {
        let line = svg
            .lines()
            .find(|l| l.starts_with("<polyline") && l.contains(marker))
            .unwrap_or_default();
        line.split('"')
            .nth(1)
            .unwrap_or_default()
            .split(' ')
            .collect()
    }

    #[test]
    fn lines_span_the_plot_and_scale_to_the_peak() {
        // Three seconds from 10 s after the epoch; 4 requests at the peak, so the axis tops
        // out at 5: the plot runs from x 80 to 980 and from y 370 (none) up to 60 (5).
        let timeline: BTreeMap<u64, Slot> = [(10, slot(4, 1)), (11, slot(2, 0)), (12, slot(0, 0))]
            .into_iter()
            .collect();
        let svg = one_policy(&timeline, Duration::from_secs(1));
        assert!(svg.contains("requests and rejections per 1s"), "{svg}");
        assert_eq!(
            line_with(&svg, "#999"),
            ["80.0,122.0", "530.0,246.0", "980.0,370.0"]
        );
        assert_eq!(
            line_with(&svg, COLOURS[0]),
            ["80.0,308.0", "530.0,370.0", "980.0,370.0"]
        );
        // No shadow limit would have rejected anything: no dashed line, none in the legend.
        assert!(!svg.contains("stroke-dasharray"), "{svg}");
        // The y scale at 0, half and the top; the time axis at the first, middle and last
        // point.
        for (y, tick) in [(370, 0), (246, 2), (60, 5)] {
            let line = format!(
                r##"<line x1="80" y1="{y}.0" x2="980" y2="{y}.0" stroke="#eee"/><text x="74" y="{}.0" text-anchor="end">{tick}</text>"##,
                y + 4
            );
            assert!(svg.contains(&line), "{line}: {svg}");
        }
        for (x, anchor, at) in [
            ("80.0", "start", "1970-01-01T00:00:10Z"),
            ("530.0", "middle", "1970-01-01T00:00:11Z"),
            ("980.0", "end", "1970-01-01T00:00:12Z"),
        ] {
            let label = format!(r#"<text x="{x}" y="390" text-anchor="{anchor}">{at}</text>"#);
            assert!(svg.contains(&label), "{label}: {svg}");
        }
        // The axes: up the left side, along the bottom.
        assert!(svg.contains(
            r#"<line x1="80" y1="60" x2="80" y2="370"/><line x1="80" y1="370" x2="980" y2="370"/>"#
        ));
    }

    #[test]
    fn shadow_rejections_are_dashed_and_every_policy_has_its_colour() {
        let shadowed: BTreeMap<u64, Slot> = [(
            0,
            Slot {
                requests: 10,
                rejected: 0,
                would_reject: 5,
            },
        )]
        .into_iter()
        .collect();
        let plain: BTreeMap<u64, Slot> = [(0, slot(10, 2))].into_iter().collect();
        let series: Vec<Series<'_>> = ["one", "two", "three", "four", "five", "six", "seven"]
            .into_iter()
            .enumerate()
            .map(|(index, label)| Series {
                label,
                timeline: if index == 1 { &shadowed } else { &plain },
            })
            .collect();
        let svg = svg(&series, Duration::from_millis(250));
        assert!(svg.contains("per 250ms"), "{svg}");
        // One point: drawn at the left edge, and the time axis says when once.
        assert_eq!(line_with(&svg, "#999"), ["80.0,60.0"]);
        assert_eq!(svg.matches("1970-01-01T00:00:00Z").count(), 1, "{svg}");
        // The second policy's shadow limit would have rejected half, dashed in its colour.
        let dashed = svg
            .lines()
            .find(|l| l.starts_with("<polyline") && l.contains("stroke-dasharray"))
            .unwrap_or_default();
        assert!(
            dashed.contains(COLOURS[1]) && dashed.contains("80.0,215.0"),
            "{svg}"
        );
        assert_eq!(line_with(&svg, COLOURS[1])[0], "80.0,370.0");
        // The seventh policy takes the first colour again.
        let rejected: Vec<&str> = svg
            .lines()
            .filter(|l| l.starts_with("<polyline") && !l.contains("#999"))
            .collect();
        assert_eq!(rejected.len(), 8, "{svg}");
        assert!(rejected[7].contains(COLOURS[0]), "{}", rejected[7]);
        // The legend, a row each, the dashed entry dashed.
        for (row, text) in [
            (0, "requests"),
            (1, "rejected: one"),
            (2, "rejected: two"),
            (3, "would reject: two"),
            (8, "rejected: seven"),
        ] {
            let ly = 40 + 16 * row;
            let entry = format!(r#"y2="{ly}" stroke="#);
            let line = svg.lines().find(|l| l.contains(&entry)).unwrap_or_default();
            assert!(
                line.ends_with(&format!(r#"y="{}">{text}</text>"#, ly + 4)),
                "{line}"
            );
            assert_eq!(line.contains("stroke-dasharray"), row == 3, "{line}");
        }
    }

    #[test]
    fn a_point_is_named_in_the_largest_whole_unit() {
        let ms = Duration::from_millis;
        assert_eq!(human(ms(250)), "250ms");
        assert_eq!(human(ms(1_500)), "1500ms");
        assert_eq!(human(ms(90_000)), "90s");
        assert_eq!(human(ms(120_000)), "2m");
        assert_eq!(human(ms(5_400_000)), "90m");
        assert_eq!(human(ms(7_200_000)), "2h");
        assert_eq!(human(ms(172_800_000)), "2d");
        assert_eq!(nice_ceiling(2), 2);
        assert_eq!(nice_ceiling(6), 10);
        assert_eq!(nice_ceiling(11), 20);
        assert_eq!(
            nice_ceiling(5_000_000_000_000_000_001),
            5_000_000_000_000_000_001
        );
    }

    #[test]
    fn points_sum_the_intervals_they_cover() {
        let timeline: BTreeMap<u64, Slot> = (0..10).map(|i| (100 + i, slot(i, 1))).collect();
        // Ten intervals as four points of three: the last holds one.
        let binned = bin(&timeline, 100, 3, 4);
        assert_eq!(binned, [slot(3, 3), slot(12, 3), slot(21, 3), slot(9, 1)]);
        let long: BTreeMap<u64, Slot> =
            [(0, slot(1, 0)), (2_000, slot(1, 0))].into_iter().collect();
        let svg = one_policy(&long, Duration::from_secs(30));
        // 2,001 intervals of 30 s as points of three (a minute and a half), 667 of them.
        assert!(svg.contains("per 90s"), "{svg}");
        assert_eq!(line_with(&svg, "#999").len(), 667);
        // The time axis names the middle point (the 334th, 333 × 90 s in) at the middle.
        let middle = r#"<text x="530.0" y="390" text-anchor="middle">1970-01-01T08:19:30Z</text>"#;
        assert!(svg.contains(middle), "{svg}");
    }
}
